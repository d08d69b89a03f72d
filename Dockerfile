# syntax=docker/dockerfile:1.7
# Images for the operator, the node agent, ramify-api and ramify-pod (the container of
# a Sandbox's Pod in cluster mode). Build one with --target:
#   docker build --target operator   -t ramify/operator:dev .
#   docker build --target node-agent -t ramify/node-agent:dev .
#   docker build --target api        -t ramify/api:dev .
#   docker build --target pod        -t ramify/pod:dev .

# The same recipe, without Docker: hack/images/ramify.sh (ramify-images.py lists what is
# in each image; e2e/tests/images_recipe.rs checks that the two agree).

# --- Rust: static binaries (glibc, crt-static; the `image` profile of Cargo.toml) ----
FROM rust:1.95-bookworm AS rust-build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crds crds
COPY engine engine
COPY remote remote
COPY image image
COPY runtime runtime
COPY operator operator
COPY node-agent node-agent
COPY api api
COPY plugin plugin
COPY e2e e2e
COPY pod pod
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    RUSTFLAGS='-C target-feature=+crt-static' \
    cargo build --locked --profile image --target x86_64-unknown-linux-gnu \
      -p ramify-operator -p ramify-node-agent -p ramify-api -p ramify-pod && \
    mkdir -p /out && \
    cp target/x86_64-unknown-linux-gnu/image/ramify-operator \
       target/x86_64-unknown-linux-gnu/image/ramify-node-agent \
       target/x86_64-unknown-linux-gnu/image/ramify-api \
       target/x86_64-unknown-linux-gnu/image/ramify-pod /out/

# --- Go: the pinned runsc (restores need the exact version that checkpointed) ------
FROM golang:1.26-bookworm AS runsc-build
WORKDIR /src/hack/runsc
COPY hack/runsc ./
RUN RAMIFY_CACHE=/cache ./build.sh && cp /cache/runsc-*/runsc /runsc && /runsc --version

# --- the root of the static images: nonroot user, CA bundle, /tmp ----------------
FROM debian:bookworm-slim AS static-root
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && \
    rm -rf /var/lib/apt/lists/* && \
    mkdir -p /static/etc/ssl/certs /static/tmp /static/home/nonroot && \
    cp /etc/ssl/certs/ca-certificates.crt /static/etc/ssl/certs/ && \
    chmod 1777 /static/tmp && chmod 0700 /static/home/nonroot && \
    chown 65532:65532 /static/home/nonroot
COPY hack/images/static-root/ /static/

# --- operator: the binary on the static root, non-root ----------------------------
FROM scratch AS operator
COPY --from=static-root /static/ /
COPY --from=rust-build /out/ramify-operator /ramify-operator
USER 65532:65532
ENTRYPOINT ["/ramify-operator"]

# --- ramify-api: the binary on the static root, non-root --------------------------
FROM scratch AS api
COPY --from=static-root /static/ /
COPY --from=rust-build /out/ramify-api /ramify-api
USER 65532:65532
ENTRYPOINT ["/ramify-api"]

# --- pod: ramify-pod alone (it needs no shell, no CA bundle, no passwd), non-root ---
FROM scratch AS pod
COPY --from=rust-build /out/ramify-pod /ramify-pod
USER 65532:65532
ENTRYPOINT ["/ramify-pod"]

# --- node agent: runsc, CNI plugins and iptables for per-sandbox networking ---------
FROM debian:bookworm-slim AS node-agent
RUN apt-get update && apt-get install -y --no-install-recommends \
      ca-certificates iproute2 iptables util-linux && \
    rm -rf /var/lib/apt/lists/*
COPY --from=runsc-build /runsc /usr/local/bin/runsc
COPY --from=rust-build /out/ramify-node-agent /usr/local/bin/ramify-node-agent
USER 0:0
ENTRYPOINT ["/usr/local/bin/ramify-node-agent"]
