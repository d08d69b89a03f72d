# The two commands a newcomer needs: `make demo` and `make test`.
.PHONY: demo down test crds fmt

demo: ## bring up the embedded default and show it
	hack/demo.sh

down: ## stop everything `make demo` started and remove its state
	hack/demo.sh down

test: ## the whole test suite, as CI runs it
	hack/test.sh

crds: ## regenerate crds/yaml from the Rust types
	cargo run -q -p ramify-crds --bin crdgen -- --write crds/yaml

fmt:
	cargo fmt --all
