//! The engine stands on its own: nothing of Kubernetes is in its dependency tree
//! (read from the workspace's Cargo.lock, dev-dependencies included). The compiler then
//! refuses any use of a Kubernetes type in it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

/// Package name -> the names of its dependencies, from Cargo.lock.
fn lock_graph(lock: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for package in lock.split("[[package]]").skip(1) {
        let name = package
            .lines()
            .find_map(|l| l.strip_prefix("name = "))
            .expect("a package name")
            .trim_matches('"')
            .to_string();
        let mut deps = BTreeSet::new();
        if let Some(start) = package.find("dependencies = [") {
            let list = &package[start..];
            let list = &list[..list.find(']').expect("a closed list")];
            for entry in list.lines().skip(1) {
                let entry = entry.trim().trim_end_matches(',').trim_matches('"');
                if let Some(dep) = entry.split(' ').next().filter(|d| !d.is_empty()) {
                    deps.insert(dep.to_string());
                }
            }
        }
        graph.entry(name).or_default().extend(deps);
    }
    graph
}

fn closure(graph: &BTreeMap<String, BTreeSet<String>>, root: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![root.to_string()];
    while let Some(p) = todo.pop() {
        if seen.insert(p.clone()) {
            todo.extend(graph.get(&p).into_iter().flatten().cloned());
        }
    }
    seen
}

#[test]
fn nothing_of_kubernetes_is_in_the_engines_dependency_tree() {
    let dir = std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let lock = std::fs::read_to_string(dir.join("../Cargo.lock")).unwrap();
    let graph = lock_graph(&lock);
    // The check itself sees Kubernetes where it is: the node agent depends on it.
    let agent = closure(&graph, "ramify-node-agent");
    assert!(agent.contains("kube") && agent.contains("ramify-crds"));
    assert!(agent.contains("ramify-engine"));

    let engine = closure(&graph, "ramify-engine");
    assert!(engine.contains("tokio"), "the engine's tree was not found");
    let kubernetes: Vec<_> = engine
        .iter()
        .filter(|p| {
            p.starts_with("kube")
                || p.starts_with("k8s-")
                || p.as_str() == "ramify-crds"
                || p.as_str() == "ramify-runtime"
        })
        .collect();
    assert!(
        kubernetes.is_empty(),
        "the engine depends on {kubernetes:?}: it must build without Kubernetes"
    );
}
