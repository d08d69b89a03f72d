//! Writes the CRD YAML generated from the Rust types, and the API reference generated
//! from the CRDs.
//!
//! `crdgen` prints the YAML; `crdgen --write DIR` writes `DIR/ramify.dev.yaml`;
//! `crdgen --check DIR` exits non-zero when that file differs (drift).
//! `crdgen --docs FILE` writes the Markdown API reference (`docs/api-reference.md`);
//! `crdgen --check-docs FILE` exits non-zero when that file differs.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => print!("{}", ramify_crds::crds_yaml()?),
        [flag, dir] if flag == "--write" => {
            let path = PathBuf::from(dir).join("ramify.dev.yaml");
            std::fs::write(&path, ramify_crds::crds_yaml()?)?;
            eprintln!("wrote {}", path.display());
        }
        [flag, dir] if flag == "--check" => {
            let path = PathBuf::from(dir).join("ramify.dev.yaml");
            let on_disk = std::fs::read_to_string(&path)?;
            if on_disk != ramify_crds::crds_yaml()? {
                return Err(format!(
                    "{} is out of date: run `cargo run -p ramify-crds --bin crdgen -- --write {dir}`",
                    path.display()
                )
                .into());
            }
        }
        [flag, file] if flag == "--docs" => {
            std::fs::write(file, ramify_crds::reference::api_reference_markdown()?)?;
            eprintln!("wrote {file}");
        }
        [flag, file] if flag == "--check-docs" => {
            let on_disk = std::fs::read_to_string(file)?;
            if on_disk != ramify_crds::reference::api_reference_markdown()? {
                return Err(format!(
                    "{file} is out of date with the CRDs: run `cargo run -p ramify-crds --bin crdgen -- --docs {file}`"
                )
                .into());
            }
        }
        _ => {
            return Err(
                "usage: crdgen [--write DIR | --check DIR | --docs FILE | --check-docs FILE]"
                    .into(),
            );
        }
    }
    Ok(())
}
