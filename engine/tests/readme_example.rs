//! The README's example is true: the page shows the code of `examples/fork.rs`, and
//! that program runs a sandbox, snapshots and forks it on real runsc (the pinned build)
//! and leaves nothing behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

fn manifest_dir() -> PathBuf {
    // At run time: the binary may have been built in another clone of the tree.
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"))
}

/// The lines between `// README: begin` and `// README: end`, one level less indented.
fn example_lines(program: &str) -> Vec<String> {
    let begin = program.find("// README: begin\n").expect("begin marker");
    let end = program.find("    // README: end").expect("end marker");
    program[begin + "// README: begin\n".len()..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l).to_string())
        .collect()
}

/// The README's Rust block, without the lines hidden from the page (`# `).
fn readme_lines(readme: &str) -> Vec<String> {
    let start = readme.find("```rust").expect("a rust block");
    let body = &readme[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let body = &body[..body.find("```").unwrap()];
    body.lines()
        .filter(|l| !l.starts_with("# "))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readme_shows_the_example_program() {
    let dir = manifest_dir();
    let program = std::fs::read_to_string(dir.join("examples/fork.rs")).unwrap();
    let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
    assert_eq!(
        readme_lines(&readme),
        example_lines(&program),
        "engine/README.md's example and examples/fork.rs differ"
    );
}

/// Built by `cargo test` beside the test binaries (`target/<profile>/examples/`).
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile_dir.join("examples/fork");
    assert!(
        bin.exists(),
        "{} is missing: cargo test builds the examples",
        bin.display()
    );
    bin
}

#[tokio::test]
async fn the_example_forks_a_live_sandbox_and_leaves_nothing_behind() {
    common::rootfs().await; // the tools are there, and we are root
    let runsc = common::current_runsc();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(example_binary())
        .arg(dir.path())
        .env("RAMIFY_RUNSC", &runsc)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the example failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["branch-0: 42", "branch-1: 42", "branch-2: 42"],
        "each branch reads what the parent wrote before its snapshot"
    );
    // Nothing of it is left: no sandbox, netns, rule or cgroup (what the orphan
    // sweep would find of a dead process), no bridge, no image, no sandbox directory.
    let swept = ramify_engine::sweep::sweep_orphans("ramify-example-", "/ramify-example").await;
    assert!(swept.is_empty(), "the example left {swept:#?}");
    assert!(
        !Path::new("/sys/class/net/rmyex0").exists(),
        "the bridge stayed"
    );
    for sub in ["state/sandboxes", "state/snapshots"] {
        let left: Vec<_> = std::fs::read_dir(dir.path().join(sub))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{sub} holds {left:?}");
    }
}
