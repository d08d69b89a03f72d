//! The committed CRD YAML and API reference must be exactly what the Rust types generate.

/// A committed file, by its path below the crate. The manifest directory is read at run
/// time (cargo sets it): a binary reused from another clone of the same tree must read
/// this clone's files (hack/lib/cargo-target.sh).
fn committed(below_crate: &str) -> (String, String) {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| panic!("CARGO_MANIFEST_DIR is not set: run under cargo test"));
    let path = format!("{dir}/{below_crate}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    (path, text)
}

#[test]
fn committed_crd_yaml_matches_the_types() {
    let generated = ramify_crds::crds_yaml().unwrap_or_else(|e| panic!("render: {e}"));
    let (path, committed) = committed("yaml/ramify.dev.yaml");
    assert!(
        committed == generated,
        "{path} is out of date with the Rust types: run `cargo run -p ramify-crds --bin crdgen -- --write crds/yaml`"
    );
}

/// docs/api-reference.md is what `crdgen --docs` makes of the CRDs.
#[test]
fn committed_api_reference_matches_the_crds() {
    let generated =
        ramify_crds::reference::api_reference_markdown().unwrap_or_else(|e| panic!("render: {e}"));
    let (path, committed) = committed("../docs/api-reference.md");
    assert!(
        committed == generated,
        "{path} is out of date with the CRDs: run `make crds` (or `cargo run -p ramify-crds --bin crdgen -- --docs docs/api-reference.md`)"
    );
}
