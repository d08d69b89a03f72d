//! The committed CRD YAML must be exactly what the Rust types generate.

#[test]
fn committed_crd_yaml_matches_the_types() {
    let generated = ramify_crds::crds_yaml().unwrap_or_else(|e| panic!("render: {e}"));
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/yaml/ramify.dev.yaml");
    let committed = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        committed == generated,
        "{path} is out of date with the Rust types: run `cargo run -p ramify-crds --bin crdgen -- --write crds/yaml`"
    );
}
