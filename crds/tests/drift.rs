//! The committed CRD YAML must be exactly what the Rust types generate.

#[test]
fn committed_crd_yaml_matches_the_types() {
    let generated = ramify_crds::crds_yaml().unwrap_or_else(|e| panic!("render: {e}"));
    // The manifest directory at run time (cargo sets it): a binary reused from another
    // clone of the same tree must read this clone's YAML (hack/lib/cargo-target.sh).
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| panic!("CARGO_MANIFEST_DIR is not set: run under cargo test"));
    let path = format!("{dir}/yaml/ramify.dev.yaml");
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        committed == generated,
        "{path} is out of date with the Rust types: run `cargo run -p ramify-crds --bin crdgen -- --write crds/yaml`"
    );
}
