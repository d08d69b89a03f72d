//! Writes the CRD YAML generated from the Rust types.
//!
//! `crdgen` prints it; `crdgen --write DIR` writes `DIR/ramify.dev.yaml`;
//! `crdgen --check DIR` exits non-zero when that file differs (drift).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let yaml = ramify_crds::crds_yaml()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => print!("{yaml}"),
        [flag, dir] if flag == "--write" => {
            let path = PathBuf::from(dir).join("ramify.dev.yaml");
            std::fs::write(&path, yaml)?;
            eprintln!("wrote {}", path.display());
        }
        [flag, dir] if flag == "--check" => {
            let path = PathBuf::from(dir).join("ramify.dev.yaml");
            let on_disk = std::fs::read_to_string(&path)?;
            if on_disk != yaml {
                return Err(format!(
                    "{} is out of date: run `cargo run -p ramify-crds --bin crdgen -- --write {dir}`",
                    path.display()
                )
                .into());
            }
        }
        _ => return Err("usage: crdgen [--write DIR | --check DIR]".into()),
    }
    Ok(())
}
