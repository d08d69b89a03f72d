# syntax=docker/dockerfile:1.7
# Images for the operator, the node agent and ramify-api. Build one with --target:
#   docker build --target operator   -t ramify/operator:dev .
#   docker build --target node-agent -t ramify/node-agent:dev .
#   docker build --target api        -t ramify/api:dev .

# --- Rust: static (musl) binaries -------------------------------------------------
FROM rust:1.95-bookworm AS rust-build
RUN rustup target add x86_64-unknown-linux-musl && \
    apt-get update && apt-get install -y --no-install-recommends musl-tools && \
    rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crds crds
COPY runtime runtime
COPY operator operator
COPY node-agent node-agent
COPY api api
COPY plugin plugin
COPY e2e e2e
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --target x86_64-unknown-linux-musl \
      -p ramify-operator -p ramify-node-agent -p ramify-api && \
    mkdir -p /out && \
    cp target/x86_64-unknown-linux-musl/release/ramify-operator \
       target/x86_64-unknown-linux-musl/release/ramify-node-agent \
       target/x86_64-unknown-linux-musl/release/ramify-api /out/

# --- Go: the pinned runsc (restores need the exact version that checkpointed) ------
FROM golang:1.26-bookworm AS runsc-build
WORKDIR /src/hack/runsc
COPY hack/runsc ./
RUN RAMIFY_CACHE=/cache ./build.sh && cp /cache/runsc-*/runsc /runsc && /runsc --version

# --- operator: nothing but the binary, non-root ------------------------------------
FROM gcr.io/distroless/static-debian12:nonroot AS operator
COPY --from=rust-build /out/ramify-operator /ramify-operator
USER 65532:65532
ENTRYPOINT ["/ramify-operator"]

# --- ramify-api: nothing but the binary, non-root ---------------------------------
FROM gcr.io/distroless/static-debian12:nonroot AS api
COPY --from=rust-build /out/ramify-api /ramify-api
USER 65532:65532
ENTRYPOINT ["/ramify-api"]

# --- node agent: runsc, CNI plugins and iptables for per-sandbox networking ---------
FROM debian:bookworm-slim AS node-agent
RUN apt-get update && apt-get install -y --no-install-recommends \
      containernetworking-plugins iptables iproute2 util-linux ca-certificates && \
    rm -rf /var/lib/apt/lists/*
COPY --from=runsc-build /runsc /usr/local/bin/runsc
COPY --from=rust-build /out/ramify-node-agent /usr/local/bin/ramify-node-agent
ENTRYPOINT ["/usr/local/bin/ramify-node-agent"]
