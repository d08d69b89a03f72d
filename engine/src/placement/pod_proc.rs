//! Finding a Pod's processes on this node: which process is in the Pod's cgroup (its
//! network namespace is the Pod's), and that cgroup's path.
//!
//! The kubelet puts every container of a Pod in a cgroup below the Pod's own:
//! cgroupfs driver `/kubepods[/burstable|/besteffort]/pod<uid>/<container>`, systemd
//! driver `/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _>.slice/
//! <container>.scope`. The Pod's cgroup is that path cut after the Pod's component.

use std::path::Path;

use crate::error::{Error, Result};

/// Whether `component` is the cgroup of the Pod with `uid`, in either driver's form.
fn is_pod_component(component: &str, uid: &str) -> bool {
    if component.strip_prefix("pod") == Some(uid) {
        return true;
    }
    let systemd = format!("-pod{}.slice", uid.replace('-', "_"));
    component.starts_with("kubepods") && component.ends_with(&systemd)
}

/// The Pod's cgroup path, when `path` (a cgroup path from /proc/<pid>/cgroup) is a
/// container of the Pod with `uid`: `path` cut after the Pod's component. `None` for
/// other Pods, the Pod's own cgroup itself, and a sandbox of ours inside it (a
/// component after the Pod's starting with `own_prefix`: it is not the Pod's).
pub fn pod_cgroup_of(path: &str, uid: &str, own_prefix: &str) -> Option<String> {
    let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let at = comps.iter().position(|c| is_pod_component(c, uid))?;
    let container = comps.get(at + 1)?;
    if container.starts_with(own_prefix) {
        return None;
    }
    // Under the kubepods tree only: a Pod uid elsewhere is not the kubelet's.
    if !comps.first().is_some_and(|c| c.starts_with("kubepods")) {
        return None;
    }
    Some(format!("/{}", comps[..=at].join("/")))
}

/// The path of the hierarchy whose cgroups runsc places the sandbox in, from the text
/// of /proc/<pid>/cgroup: the memory controller's (cgroup v1, the limit the kubelet
/// sets), else the unified one (`0::`, cgroup v2).
pub fn memory_path(proc_cgroup: &str) -> Option<&str> {
    let mut unified = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.split(',').any(|c| c == "memory") {
            return Some(path);
        }
        if controllers.is_empty() {
            unified = Some(path);
        }
    }
    unified
}

/// A process of the Pod with `uid` and the Pod's cgroup path, found by scanning
/// `<proc>/*/cgroup`. Processes of sandboxes of ours (`own_prefix`) are skipped.
pub fn find(proc: &Path, uid: &str, own_prefix: &str) -> Result<(i32, String)> {
    if uid.is_empty() || uid.contains('/') {
        return Err(Error::Pod(format!("{uid:?} is not a Pod UID")));
    }
    let rd = std::fs::read_dir(proc).map_err(|e| Error::io("read", proc, e))?;
    let mut pids: Vec<i32> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    // The oldest first: the Pod's pause or ramify-pod process, not a passing one.
    pids.sort_unstable();
    for pid in pids {
        // A process that exits meanwhile is skipped: any other of the Pod will do.
        let Ok(text) = std::fs::read_to_string(proc.join(pid.to_string()).join("cgroup")) else {
            continue;
        };
        if let Some(cg) = memory_path(&text).and_then(|p| pod_cgroup_of(p, uid, own_prefix)) {
            return Ok((pid, cg));
        }
    }
    Err(Error::Pod(format!(
        "no process of Pod {uid} runs on this node (no cgroup of it under kubepods in {})",
        proc.display()
    )))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const UID: &str = "0f3c4a2e-1b2c-4d5e-8f90-123456789abc";

    #[test]
    fn cgroupfs_driver_paths() {
        for (path, want) in [
            (
                format!("/kubepods/pod{UID}/abc123"),
                format!("/kubepods/pod{UID}"),
            ),
            (
                format!("/kubepods/burstable/pod{UID}/abc123"),
                format!("/kubepods/burstable/pod{UID}"),
            ),
            (
                format!("/kubepods/besteffort/pod{UID}/abc123"),
                format!("/kubepods/besteffort/pod{UID}"),
            ),
        ] {
            assert_eq!(pod_cgroup_of(&path, UID, "ramify-"), Some(want), "{path}");
        }
    }

    #[test]
    fn systemd_driver_paths() {
        let u = UID.replace('-', "_");
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-abc.scope"
        );
        assert_eq!(
            pod_cgroup_of(&path, UID, "ramify-").as_deref(),
            Some(
                format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice")
                    .as_str()
            )
        );
        let guaranteed = format!("/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-abc.scope");
        assert!(pod_cgroup_of(&guaranteed, UID, "ramify-").is_some());
    }

    #[test]
    fn other_pods_our_sandboxes_and_the_pod_cgroup_itself_do_not_count() {
        let other = "11111111-2222-3333-4444-555555555555";
        assert_eq!(
            pod_cgroup_of(&format!("/kubepods/pod{other}/c"), UID, "ramify-"),
            None
        );
        assert_eq!(
            pod_cgroup_of(&format!("/kubepods/pod{UID}/ramify-node-1"), UID, "ramify-"),
            None
        );
        assert_eq!(
            pod_cgroup_of(&format!("/kubepods/pod{UID}"), UID, "ramify-"),
            None
        );
        assert_eq!(
            pod_cgroup_of(&format!("/elsewhere/pod{UID}/c"), UID, "ramify-"),
            None
        );
        // A uid that is a prefix of the component is not a match.
        assert_eq!(
            pod_cgroup_of(&format!("/kubepods/pod{UID}x/c"), UID, "ramify-"),
            None
        );
    }

    #[test]
    fn memory_hierarchy_first_then_unified() {
        let v1 = "12:memory:/kubepods/burstable/podX/c\n11:cpu,cpuacct:/kubepods/burstable/podX/c\n1:name=systemd:/x\n0::/y\n";
        assert_eq!(memory_path(v1), Some("/kubepods/burstable/podX/c"));
        assert_eq!(
            memory_path("0::/kubepods/podX/c\n"),
            Some("/kubepods/podX/c")
        );
        assert_eq!(memory_path("1:name=systemd:/x\n"), None);
    }

    #[test]
    fn finds_the_oldest_process_of_the_pod_in_a_proc_tree() {
        let proc = tempfile::tempdir().unwrap();
        let write = |pid: &str, text: &str| {
            let d = proc.path().join(pid);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cgroup"), text).unwrap();
        };
        write("7", "4:memory:/kubepods/podother/c\n");
        write(
            "12",
            &format!("4:memory:/kubepods/besteffort/pod{UID}/ramify-node-x\n"),
        );
        write(
            "40",
            &format!("4:memory:/kubepods/besteffort/pod{UID}/ctr\n"),
        );
        write(
            "31",
            &format!("4:memory:/kubepods/besteffort/pod{UID}/pause\n"),
        );
        std::fs::create_dir_all(proc.path().join("self")).unwrap();
        let (pid, cg) = find(proc.path(), UID, "ramify-").unwrap();
        assert_eq!(pid, 31);
        assert_eq!(cg, format!("/kubepods/besteffort/pod{UID}"));
        assert!(matches!(
            find(proc.path(), "nope", "ramify-"),
            Err(Error::Pod(_))
        ));
        assert!(find(proc.path(), "../x", "ramify-").is_err());
    }
}
