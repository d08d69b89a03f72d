# The two commands a newcomer needs: `make demo` and `make test`.
.PHONY: demo down test bench crds fmt

demo: ## bring up the embedded default and show it
	hack/demo.sh

down: ## stop everything `make demo` started and remove its state
	hack/demo.sh down

test: ## the whole test suite, as CI runs it
	hack/test.sh

bench: ## every benchmark in full, beside its baseline (a quiet machine; about 40 minutes)
	hack/bench.sh

crds: ## regenerate crds/yaml from the Rust types, its copies in the chart and config/crd, and docs/api-reference.md
	cargo run -q -p ramify-crds --bin crdgen -- --write crds/yaml
	cargo run -q -p ramify-crds --bin crdgen -- --docs docs/api-reference.md
	cp crds/yaml/ramify.dev.yaml charts/ramify/crds/ramify.dev.yaml
	cp crds/yaml/ramify.dev.yaml config/crd/ramify.dev.yaml

fmt:
	cargo fmt --all
