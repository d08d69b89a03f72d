//! ramify's images have two recipes: `Dockerfile` (for users with Docker) and
//! `hack/images/ramify-images.py` (built here without Docker, what the Helm e2e test
//! installs). This reads both and checks that they list the same contents: per image the
//! Debian suite, the Debian packages, the trees copied from the repository, every binary
//! and its path, the user and the entrypoint; and the same static build of the binaries
//! (cargo profile, target, RUSTFLAGS, crates). A change to one side only fails here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use ramify_e2e::repo_root;
use serde::Deserialize;

#[derive(Debug, Deserialize, PartialEq, Eq, Clone, Default)]
struct Image {
    suite: String,
    packages: BTreeSet<String>,
    trees: BTreeSet<String>,
    /// Path in the image -> the binary's name.
    binaries: BTreeMap<String, String>,
    user: String,
    entrypoint: Vec<String>,
}

#[derive(Debug, Deserialize, PartialEq, Eq, Clone, Default)]
struct Cargo {
    profile: String,
    target: String,
    rustflags: String,
    crates: BTreeSet<String>,
}

#[derive(Debug, Deserialize, PartialEq, Eq, Clone, Default)]
struct Recipe {
    cargo: Cargo,
    images: BTreeMap<String, Image>,
}

/// The builder's own statement of its recipe (the data it builds from).
fn builder_recipe() -> Recipe {
    let out = Command::new("python3")
        .arg(repo_root().join("hack/images/ramify-images.py"))
        .arg("recipe")
        .output()
        .expect("running python3 hack/images/ramify-images.py recipe");
    assert!(
        out.status.success(),
        "ramify-images.py recipe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("ramify-images.py recipe prints JSON")
}

#[derive(Debug, Default)]
struct Stage {
    from: String,
    runs: Vec<String>,
    /// (--from stage or None for the build context, sources, destination)
    copies: Vec<(Option<String>, Vec<String>, String)>,
    user: Option<String>,
    entrypoint: Option<Vec<String>>,
}

/// The Dockerfile's instructions, continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(body) = t.strip_suffix('\\') {
            cur.push_str(body);
            cur.push(' ');
            continue;
        }
        cur.push_str(t);
        let (op, rest) = cur.split_once(char::is_whitespace).unwrap_or((&cur, ""));
        out.push((op.to_uppercase(), rest.trim().to_string()));
        cur.clear();
    }
    out
}

fn stages(text: &str) -> BTreeMap<String, Stage> {
    let mut stages: BTreeMap<String, Stage> = BTreeMap::new();
    let mut name = String::new();
    for (op, rest) in instructions(text) {
        if op == "FROM" {
            let words: Vec<&str> = rest.split_whitespace().collect();
            assert!(
                words.len() == 3 && words[1].eq_ignore_ascii_case("as"),
                "every FROM names its stage: FROM {rest}"
            );
            name = words[2].to_string();
            stages.insert(
                name.clone(),
                Stage {
                    from: words[0].to_string(),
                    ..Stage::default()
                },
            );
            continue;
        }
        let stage = stages.get_mut(&name).expect("an instruction before FROM");
        match op.as_str() {
            "RUN" => stage.runs.push(rest),
            "COPY" => {
                let mut from = None;
                let mut paths = Vec::new();
                for w in rest.split_whitespace() {
                    if let Some(f) = w.strip_prefix("--from=") {
                        from = Some(f.to_string());
                    } else if !w.starts_with("--") {
                        paths.push(w.to_string());
                    }
                }
                let dest = paths.pop().expect("COPY has a destination");
                stage.copies.push((from, paths, dest));
            }
            "USER" => stage.user = Some(rest),
            "ENTRYPOINT" => {
                stage.entrypoint =
                    Some(serde_json::from_str(&rest).expect("ENTRYPOINT in exec (JSON) form"))
            }
            _ => {}
        }
    }
    stages
}

/// The words after `apt-get install` up to the end of that command, options dropped.
fn apt_packages(run: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = run;
    while let Some(i) = rest.find("apt-get install") {
        rest = &rest[i + "apt-get install".len()..];
        for w in rest.split_whitespace() {
            if w == "&&" || w == ";" || w == "||" {
                break;
            }
            if !w.starts_with('-') {
                out.insert(w.to_string());
            }
        }
    }
    out
}

/// `debian:bookworm-slim` -> `bookworm`.
fn suite_of(from: &str) -> Option<String> {
    let tag = from.strip_prefix("debian:")?;
    Some(tag.trim_end_matches("-slim").to_string())
}

/// A shell word after `flag` in a command line (`--profile image`).
fn flag_values(cmd: &str, flag: &str) -> Vec<String> {
    let words: Vec<&str> = cmd.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].to_string())
        .collect()
}

/// The Dockerfile's recipe in the builder's terms.
fn dockerfile_recipe(text: &str) -> Recipe {
    let stages = stages(text);
    let rust = stages.get("rust-build").expect("a rust-build stage");
    let build = rust
        .runs
        .iter()
        .find(|r| r.contains("cargo build"))
        .expect("rust-build runs cargo build");
    // The cargo command itself: from RUSTFLAGS (if set before it) to its `&&`.
    let start = build
        .find("RUSTFLAGS=")
        .unwrap_or_else(|| build.find("cargo build").unwrap_or(0));
    let build = build[start..].split("&&").next().unwrap_or_default();
    let rustflags = build
        .split_once("RUSTFLAGS='")
        .and_then(|(_, r)| r.split_once('\''))
        .map(|(flags, _)| flags.to_string())
        .unwrap_or_default();
    let one = |flag: &str| {
        flag_values(build, flag)
            .into_iter()
            .next()
            .unwrap_or_default()
    };
    let cargo = Cargo {
        profile: one("--profile"),
        target: one("--target"),
        rustflags,
        crates: flag_values(build, "-p").into_iter().collect(),
    };
    let mut images = BTreeMap::new();
    for (name, stage) in &stages {
        let Some(entrypoint) = stage.entrypoint.clone() else {
            continue;
        };
        let mut image = Image {
            user: stage.user.clone().unwrap_or_else(|| "0:0".to_string()),
            entrypoint,
            ..Image::default()
        };
        // This stage and every stage whose whole root it copies to its own.
        let mut parts = vec![stage];
        for (from, _, dest) in &stage.copies {
            if let (Some(from), "/") = (from, dest.as_str()) {
                parts.push(stages.get(from).expect("COPY --from names a stage"));
            }
        }
        for part in parts {
            if let Some(suite) = suite_of(&part.from) {
                image.suite = suite;
            }
            for run in &part.runs {
                image.packages.extend(apt_packages(run));
            }
            for (from, srcs, dest) in &part.copies {
                match from.as_deref() {
                    None => image
                        .trees
                        .extend(srcs.iter().map(|s| s.trim_end_matches('/').to_string())),
                    Some("rust-build") | Some("runsc-build") => {
                        for src in srcs {
                            let bin = src.rsplit('/').next().unwrap_or(src).to_string();
                            image.binaries.insert(dest.clone(), bin);
                        }
                    }
                    _ => {}
                }
            }
        }
        images.insert(name.clone(), image);
    }
    Recipe { cargo, images }
}

fn dockerfile() -> String {
    std::fs::read_to_string(repo_root().join("Dockerfile")).expect("reading Dockerfile")
}

#[test]
fn dockerfile_and_the_docker_free_build_list_the_same_contents() {
    let docker = dockerfile_recipe(&dockerfile());
    let builder = builder_recipe();
    // Not vacuous: the images and their essentials are there on both sides.
    assert_eq!(
        builder.images.keys().collect::<Vec<_>>(),
        ["api", "node-agent", "operator", "pod"]
    );
    assert!(builder.images["node-agent"].packages.contains("iptables"));
    assert_eq!(
        builder.images["node-agent"].binaries["/usr/local/bin/runsc"],
        "runsc"
    );
    assert_eq!(builder.images["operator"].user, "65532:65532");
    assert_eq!(docker.cargo, builder.cargo, "the binaries' build differs");
    for (name, want) in &builder.images {
        let got = docker
            .images
            .get(name)
            .unwrap_or_else(|| panic!("Dockerfile has no {name} stage"));
        assert_eq!(
            got, want,
            "image {name}: Dockerfile (left) vs ramify-images.py"
        );
    }
    assert_eq!(
        docker.images.keys().collect::<Vec<_>>(),
        builder.images.keys().collect::<Vec<_>>(),
        "the Dockerfile has images the builder does not build"
    );
}

/// The comparison sees each kind of change on the Dockerfile's side.
#[test]
fn a_dockerfile_change_is_seen() {
    let text = dockerfile();
    let base = dockerfile_recipe(&text);
    let builder = builder_recipe();
    assert_eq!(base, builder);
    for (from, to) in [
        (
            "iproute2 iptables util-linux",
            "iproute2 nftables util-linux",
        ),
        ("/usr/local/bin/runsc", "/usr/bin/runsc"),
        ("USER 65532:65532", "USER 1000:1000"),
        (
            "ENTRYPOINT [\"/ramify-api\"]",
            "ENTRYPOINT [\"/ramify-api\", \"--x\"]",
        ),
        ("--profile image", "--profile release"),
        ("+crt-static", "-crt-static"),
        ("COPY hack/images/static-root/ /static/", ""),
        (
            "FROM debian:bookworm-slim AS node-agent",
            "FROM debian:trixie-slim AS node-agent",
        ),
    ] {
        assert!(text.contains(from), "the Dockerfile has {from:?}");
        let changed = dockerfile_recipe(&text.replacen(from, to, 1));
        assert_ne!(changed, builder, "replacing {from:?} by {to:?} went unseen");
    }
}
