//! The test registry and its images, against the real thing: distribution behind the
//! auth front on loopback, the images built by hack/images and pulled back with crane.
//! What the node agent's image tests rely on is checked here first: who may pull what,
//! that the digests are stable, and that every layer holds exactly the entries meant.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail, ensure};
use ramify_e2e::registry::{ImageRef, Registry};

fn output(cmd: &mut Command) -> Result<Output> {
    cmd.stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))
}

/// Runs a command that must succeed; returns its stdout.
fn ok(cmd: &mut Command) -> Result<String> {
    let out = output(cmd)?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn json(text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).with_context(|| format!("not JSON: {text}"))
}

/// The HTTP status of a GET, with optional Basic credentials (curl: no client library
/// that might retry or add credentials of its own).
fn http_status(url: &str, user_pass: Option<&str>) -> Result<(u16, String)> {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "10"]);
    cmd.args([
        "-H",
        "Accept: application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json",
    ]);
    if let Some(up) = user_pass {
        cmd.args(["-u", up]);
    }
    let out = ok(cmd.arg(url))?;
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", out.as_str()));
    Ok((code.trim().parse()?, body.to_string()))
}

/// One tar entry as read back from a layer blob: (name, type, mode, linkname, size,
/// devmajor, devminor), type as tar's flag ('0' file, '1' hard link, '2' symlink,
/// '3' char device, '4' block device, '5' directory).
type TarEntry = (String, char, u32, String, u64, u32, u32);

const LIST_TAR: &str = r#"
import json, sys, tarfile
with tarfile.open(sys.argv[1], "r:gz") as t:
    for m in t:
        print(json.dumps([m.name, m.type.decode(), m.mode, m.linkname, m.size, m.devmajor, m.devminor, m.mtime, m.uname, m.gname]))
"#;

/// The entries of a layer blob, fetched from the registry by digest with crane, in
/// tar order. Also checks what every layer promises: mtime 0, no owner names.
fn layer_entries(
    reg: &Registry,
    repo_ref: &str,
    layer_digest: &str,
    scratch: &Path,
) -> Result<Vec<TarEntry>> {
    let repo = repo_ref
        .rsplit_once(':')
        .map(|(r, _)| r)
        .unwrap_or(repo_ref);
    let blob = scratch.join(layer_digest.replace(':', "-"));
    let file = std::fs::File::create(&blob)?;
    let status = reg
        .crane_authed()
        .args(["blob", &format!("{repo}@{layer_digest}")])
        .stdout(file)
        .status()?;
    ensure!(status.success(), "crane blob {repo}@{layer_digest} failed");
    let listing = ok(Command::new("python3").args(["-c", LIST_TAR]).arg(&blob))?;
    let mut out = Vec::new();
    for line in listing.lines() {
        let v = json(line)?;
        let s = |i: usize| v[i].as_str().unwrap_or_default().to_string();
        let n = |i: usize| v[i].as_u64().unwrap_or(u64::MAX);
        ensure!(n(7) == 0, "{layer_digest}: {} has mtime {}", s(0), n(7));
        ensure!(
            s(8).is_empty() && s(9).is_empty(),
            "{layer_digest}: {} names its owner",
            s(0)
        );
        out.push((
            s(0),
            s(1).chars().next().unwrap_or('?'),
            n(2) as u32,
            s(3),
            n(4),
            n(5) as u32,
            n(6) as u32,
        ));
    }
    Ok(out)
}

/// Runs python3 `script` on an image's flattened filesystem (`crane export`, which
/// applies whiteouts, pulled with the credentials) with `arg`; returns its stdout.
fn on_export(reg: &Registry, reference: &str, script: &str, arg: &str) -> Result<String> {
    let scratch = tempdir("export")?;
    let tar = scratch.join("fs.tar");
    let status = reg
        .crane_authed()
        .args(["export", reference])
        .arg(&tar)
        .status()?;
    ensure!(status.success(), "crane export {reference} failed");
    let out = output(
        Command::new("python3")
            .args(["-c", script])
            .arg(&tar)
            .arg(arg),
    )?;
    ensure!(
        out.status.success(),
        "{reference}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The content of one file of an image's flattened filesystem.
fn exported_file(reg: &Registry, reference: &str, path: &str) -> Result<String> {
    let read = "import sys, tarfile\nwith tarfile.open(sys.argv[1]) as t:\n    sys.stdout.write(t.extractfile(sys.argv[2]).read().decode())";
    on_export(reg, reference, read, path)
}

/// The paths under `prefix` in an image's flattened filesystem, sorted.
fn exported_names(reg: &Registry, reference: &str, prefix: &str) -> Result<Vec<String>> {
    let list = "import sys, tarfile\nwith tarfile.open(sys.argv[1]) as t:\n    print('\\n'.join(sorted(n for n in t.getnames() if n.startswith(sys.argv[2]))))";
    Ok(on_export(reg, reference, list, prefix)?
        .lines()
        .map(str::to_string)
        .collect())
}

fn manifest(reg: &Registry, reference: &str) -> Result<serde_json::Value> {
    json(&ok(reg.crane_authed().args(["manifest", reference]))?)
}

fn layer_digests(m: &serde_json::Value) -> Vec<String> {
    m["layers"]
        .as_array()
        .map(|ls| {
            ls.iter()
                .filter_map(|l| l["digest"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn entry(name: &str, kind: char, mode: u32, link: &str, size: u64) -> TarEntry {
    (name.to_string(), kind, mode, link.to_string(), size, 0, 0)
}

/// A marker layer: /etc and one file in it holding `text`.
fn etc_marker(file: &str, text: &str) -> Vec<TarEntry> {
    vec![
        entry("etc", '5', 0o755, "", 0),
        entry(file, '0', 0o644, "", text.len() as u64),
    ]
}

#[test]
fn anonymous_pull_of_busybox_gives_the_built_digest_and_config() -> Result<()> {
    let reg = Registry::shared()?;
    let busybox = reg.image("busybox:1")?;
    let digest = ok(reg.crane()?.args(["digest", &busybox.reference]))?;
    assert_eq!(digest, busybox.digest, "the registry's digest of busybox:1");
    // Anonymous, over plain HTTP: the manifest endpoint answers 200 without credentials.
    let (code, _) = http_status(
        &format!("http://{}/v2/busybox/manifests/1", reg.addr()),
        None,
    )?;
    assert_eq!(code, 200);
    let config = json(&ok(reg.crane()?.args(["config", &busybox.reference]))?)?;
    assert_eq!(config["os"], "linux");
    assert_eq!(config["architecture"], "amd64");
    let c = &config["config"];
    assert_eq!(c["Entrypoint"], serde_json::json!(["/bin/sh", "-c"]));
    assert!(
        c["Cmd"][0].as_str().is_some_and(|s| s.contains("sleep")),
        "{c}"
    );
    assert_eq!(c["WorkingDir"], "/home/app");
    assert_eq!(c["User"], "1000:1000");
    assert!(
        c["Env"]
            .as_array()
            .is_some_and(|e| e.iter().any(|v| v == "RAMIFY_IMAGE=busybox")),
        "{c}"
    );
    assert!(
        config.get("created").is_none(),
        "no timestamp in the config: {config}"
    );
    // The flattened filesystem: the static busybox, its applets, the marker.
    let scratch = tempdir("busybox")?;
    let m = manifest(&reg, &busybox.reference)?;
    let layers = layer_digests(&m);
    assert_eq!(layers.len(), 2, "base + marker: {m}");
    let base = layer_entries(&reg, &busybox.reference, &layers[0], &scratch)?;
    let names: BTreeSet<&str> = base.iter().map(|e| e.0.as_str()).collect();
    for want in ["bin/busybox", "bin/sh", "etc/passwd", "home/app", "tmp"] {
        assert!(names.contains(want), "{want} missing from the base layer");
    }
    let sh = base.iter().find(|e| e.0 == "bin/sh").context("bin/sh")?;
    assert_eq!((sh.1, sh.3.as_str()), ('2', "/bin/busybox"));
    let mut sorted = base.iter().map(|e| e.0.clone()).collect::<Vec<_>>();
    sorted.sort();
    assert_eq!(
        sorted,
        base.iter().map(|e| e.0.clone()).collect::<Vec<_>>(),
        "entries sorted"
    );
    let marker = layer_entries(&reg, &busybox.reference, &layers[1], &scratch)?;
    assert_eq!(marker, etc_marker("etc/ramify-image", "busybox v1\n"));
    assert_eq!(
        exported_file(&reg, &busybox.reference, "etc/ramify-image")?,
        "busybox v1\n"
    );
    assert_eq!(
        exported_file(
            &reg,
            &reg.image("private/busybox:1")?.reference,
            "etc/ramify-image"
        )?,
        "private busybox v1\n"
    );
    Ok(())
}

#[test]
fn private_repository_needs_the_right_credentials() -> Result<()> {
    let reg = Registry::shared()?;
    let private = reg.image("private/busybox:1")?;
    let url = format!("http://{}/v2/private/busybox/manifests/1", reg.addr());
    let creds = reg.credentials();
    // No credentials: 401 with a Basic challenge, nothing of the manifest.
    let (code, body) = http_status(&url, None)?;
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("UNAUTHORIZED"), "{body}");
    let anon = output(reg.crane()?.args(["digest", &private.reference]))?;
    assert!(
        !anon.status.success(),
        "crane without credentials pulled the private image"
    );
    assert!(
        String::from_utf8_lossy(&anon.stderr).contains("401")
            || String::from_utf8_lossy(&anon.stderr).contains("UNAUTHORIZED"),
        "{}",
        String::from_utf8_lossy(&anon.stderr)
    );
    // Wrong password (and an unknown user): refused, here and on public repositories.
    let wrong = format!("{}:not-{}", creds.username, creds.password);
    assert_eq!(http_status(&url, Some(&wrong))?.0, 401);
    assert_eq!(
        http_status(&url, Some(&format!("nobody:{}", creds.password)))?.0,
        401
    );
    assert_eq!(
        http_status(
            &format!("http://{}/v2/busybox/manifests/1", reg.addr()),
            Some(&wrong)
        )?
        .0,
        401
    );
    // Dot segments or escapes cannot smuggle a private path past the front.
    let sneaky = format!(
        "http://{}/v2/busybox/../private/busybox/manifests/1",
        reg.addr()
    );
    let out = ok(Command::new("curl").args([
        "-s",
        "--path-as-is",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &sneaky,
    ]))?;
    assert_eq!(out, "400");
    let escaped = format!("http://{}/v2/private%2Fbusybox/manifests/1", reg.addr());
    assert_ne!(http_status(&escaped, None)?.0, 200);
    // The right credentials: the manifest, with the digest the build recorded.
    let right = format!("{}:{}", creds.username, creds.password);
    let (code, body) = http_status(&url, Some(&right))?;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        ok(reg.crane_authed().args(["digest", &private.reference]))?,
        private.digest
    );
    // The pull secret the tests hand to Kubernetes names this registry and user.
    let cfg = json(&reg.dockerconfigjson()?)?;
    assert_eq!(
        cfg["auths"][reg.addr()]["username"],
        creds.username.as_str()
    );
    // And crane given the wrong pull secret is refused.
    let wrong_dir = tempdir("wrong-secret")?;
    std::fs::write(wrong_dir.join("config.json"), reg.wrong_dockerconfigjson()?)?;
    let refused = output(
        reg.crane()?
            .env("DOCKER_CONFIG", &*wrong_dir)
            .args(["digest", &private.reference]),
    )?;
    assert!(
        !refused.status.success(),
        "the wrong pull secret pulled the private image"
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("UNAUTHORIZED"));
    assert_ne!(
        private.digest,
        reg.image("busybox:1")?.digest,
        "private has its own marker"
    );
    Ok(())
}

#[test]
fn images_are_reproducible() -> Result<()> {
    let reg = Registry::shared()?;
    // A second build from scratch (no cache) gives every digest the registry holds.
    let out = tempdir("layouts")?;
    let status = Command::new(ramify_e2e::repo_root().join("hack/images/build.sh"))
        .args(["layouts"])
        .arg(&*out)
        .env("RAMIFY_REGISTRY_DIR", reg.dir())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()?;
    ensure!(status.success(), "hack/images/build.sh layouts failed");
    let rebuilt = json(&std::fs::read_to_string(out.join("layouts.json"))?)?;
    let images = reg.images()?;
    let mut checked = 0;
    for (name, img) in &images {
        if name == "busybox:moving" {
            continue; // a tag another test moves; moving_a_tag_keeps_the_old_digest_pullable checks it
        }
        assert_eq!(
            rebuilt[name.as_str()]["digest"].as_str(),
            Some(img.digest.as_str()),
            "{name} rebuilt"
        );
        assert_eq!(
            ok(reg.crane_authed().args(["digest", &img.reference]))?,
            img.digest,
            "{name} in the registry"
        );
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} images checked: {images:?}");
    Ok(())
}

#[test]
fn multi_arch_index_offers_both_platforms() -> Result<()> {
    let reg = Registry::shared()?;
    let multi = reg.image("multi:1")?;
    let index = manifest(&reg, &multi.reference)?;
    assert_eq!(
        index["mediaType"],
        "application/vnd.oci.image.index.v1+json"
    );
    let entries = index["manifests"].as_array().context("manifests")?;
    let platforms: Vec<String> = entries
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["platform"]["os"].as_str().unwrap_or(""),
                m["platform"]["architecture"].as_str().unwrap_or("")
            )
        })
        .collect();
    // arm64 first, so a puller that takes the first entry gets the wrong one.
    assert_eq!(platforms, ["linux/arm64", "linux/amd64"]);
    assert_eq!(
        entries[1]["digest"].as_str(),
        Some(reg.image("busybox:1")?.digest.as_str())
    );
    // Resolved by platform, each entry is a real image with its own config.
    let amd = ok(reg
        .crane()?
        .args(["digest", "--platform", "linux/amd64", &multi.reference]))?;
    assert_eq!(amd, reg.image("busybox:1")?.digest);
    let arm_config = json(&ok(reg.crane()?.args([
        "config",
        "--platform",
        "linux/arm64",
        &multi.reference,
    ]))?)?;
    assert_eq!(arm_config["architecture"], "arm64");
    let arm = manifest(
        &reg,
        &format!(
            "{}@{}",
            multi.reference.rsplit_once(':').map(|p| p.0).unwrap_or(""),
            entries[0]["digest"].as_str().unwrap_or("")
        ),
    )?;
    let scratch = tempdir("multi")?;
    let layers = layer_digests(&arm);
    assert_eq!(layers.len(), 1);
    let marker = layer_entries(&reg, &multi.reference, &layers[0], &scratch)?;
    assert_eq!(marker, etc_marker("etc/ramify-platform", "linux/arm64\n"));
    Ok(())
}

#[test]
fn whiteout_and_hostile_layers_hold_exactly_the_intended_entries() -> Result<()> {
    let reg = Registry::shared()?;
    let scratch = tempdir("layers")?;
    let base = layer_digests(&manifest(&reg, &reg.image("busybox:1")?.reference)?)[0].clone();
    let layers_of = |name: &str| -> Result<Vec<Vec<TarEntry>>> {
        let img: ImageRef = reg.image(name)?;
        let m = manifest(&reg, &img.reference)?;
        let layers = layer_digests(&m);
        ensure!(
            layers.first() == Some(&base),
            "{name} is not built on the busybox base: {m}"
        );
        layers[1..]
            .iter()
            .map(|l| layer_entries(&reg, &img.reference, l, &scratch))
            .collect()
    };
    let d = |n: &str| entry(n, '5', 0o755, "", 0);
    let f = |n: &str, size: u64| entry(n, '0', 0o644, "", size);
    let wh = |n: &str| entry(n, '0', 0o600, "", 0);
    assert_eq!(
        layers_of("whiteout:1")?,
        vec![
            vec![
                d("data"),
                f("data/keep.txt", 5),
                f("data/gone.txt", 5),
                d("data/olddir"),
                f("data/olddir/file.txt", 4),
                d("opaque"),
                f("opaque/old1.txt", 5),
                d("opaque/sub"),
                f("opaque/sub/old2.txt", 5)
            ],
            vec![
                d("data"),
                wh("data/.wh.gone.txt"),
                wh("data/.wh.olddir"),
                d("opaque"),
                wh("opaque/.wh..wh..opq"),
                f("opaque/new.txt", 4)
            ],
        ]
    );
    // What a correct unpacker makes of them (crane's flattening as the reference).
    assert_eq!(
        exported_names(&reg, &reg.image("whiteout:1")?.reference, "data")?,
        ["data", "data/keep.txt"]
    );
    assert_eq!(
        exported_names(&reg, &reg.image("whiteout:1")?.reference, "opaque")?,
        ["opaque", "opaque/new.txt"]
    );
    assert_eq!(
        layers_of("hostile/dotdot:1")?,
        vec![vec![
            f("../ramify-escape-dotdot", 8),
            f("a/../../ramify-escape-dotdot2", 8)
        ]]
    );
    assert_eq!(
        layers_of("hostile/symlink:1")?,
        vec![vec![
            entry("etc/x", '2', 0o777, "/", 0),
            f("etc/x/tmp/ramify-escape-symlink", 8),
            entry("rel", '2', 0o777, "../../../..", 0),
            f("rel/tmp/ramify-escape-symlink-rel", 8),
        ]]
    );
    let mut mem = entry("dev/ramify-mem", '3', 0o666, "", 0);
    (mem.5, mem.6) = (1, 1);
    let mut sda = entry("dev/ramify-sda", '4', 0o666, "", 0);
    (sda.5, sda.6) = (8, 0);
    assert_eq!(layers_of("hostile/device:1")?, vec![vec![mem, sda]]);
    let many = layers_of("hostile/manyfiles:1")?;
    assert_eq!(many.len(), 1);
    let files: Vec<&TarEntry> = many[0].iter().filter(|e| e.1 == '0').collect();
    let dirs: Vec<&TarEntry> = many[0].iter().filter(|e| e.1 == '5').collect();
    assert_eq!(
        (files.len(), dirs.len(), many[0].len()),
        (10_000, 101, 10_101)
    );
    assert_eq!(files[0].0, "many/d000/f00000");
    assert_eq!(files[9_999].0, "many/d099/f09999");
    assert!(files.iter().all(|e| e.4 == 16));
    let busybox_size = base_entry_size(&reg, &base, &scratch)?;
    assert_eq!(
        layers_of("hostile/setuid:1")?,
        vec![vec![
            d("bin"),
            entry("bin/ramify-setuid", '0', 0o4755, "", busybox_size),
            entry("bin/ramify-setgid", '0', 0o2755, "", busybox_size),
        ]]
    );
    assert_eq!(
        layers_of("hostile/hardlink:1")?,
        vec![vec![
            d("etc"),
            entry("etc/ramify-shadow", '1', 0o644, "/etc/shadow", 0),
            entry(
                "etc/ramify-hostname",
                '1',
                0o644,
                "../../../etc/hostname",
                0
            ),
        ]]
    );
    Ok(())
}

/// hostile/corrupt:1's top layer, as served, does not match its digest (so a puller
/// that verifies blobs must refuse it), while its manifest and base layer are intact.
#[test]
fn corrupt_image_serves_a_layer_that_fails_its_digest() -> Result<()> {
    let reg = Registry::shared()?;
    let img = reg.image("hostile/corrupt:1")?;
    assert_eq!(
        ok(reg.crane()?.args(["digest", &img.reference]))?,
        img.digest
    );
    let m = manifest(&reg, &img.reference)?;
    let layers = layer_digests(&m);
    let repo = img
        .reference
        .rsplit_once(':')
        .map(|p| p.0)
        .unwrap_or_default();
    let url = format!(
        "http://{}/v2/{}/blobs/{}",
        reg.addr(),
        &repo[reg.addr().len() + 1..],
        layers[1]
    );
    let scratch = tempdir("corrupt")?;
    let blob = scratch.join("layer");
    let fetched = ok(Command::new("curl")
        .args(["-s", "-f", "-o"])
        .arg(&blob)
        .arg(&url))?;
    assert!(fetched.is_empty());
    let bytes = std::fs::read(&blob)?;
    assert_eq!(
        Some(bytes.len() as u64),
        m["layers"][1]["size"].as_u64(),
        "same size"
    );
    let sha = ok(Command::new("sha256sum").arg(&blob))?;
    assert_ne!(
        format!("sha256:{}", &sha[..64]),
        layers[1],
        "the served layer matches its digest"
    );
    // crane verifies what it reads: the pull fails on the digest.
    let pull = output(
        reg.crane()?
            .args(["export", &img.reference, "-"])
            .stdout(Stdio::null()),
    )?;
    assert!(!pull.status.success(), "crane accepted the corrupt layer");
    // The base layer it shares with busybox:1 is untouched.
    let base = layer_entries(&reg, &img.reference, &layers[0], &scratch)?;
    assert!(base.iter().any(|e| e.0 == "bin/busybox"));
    Ok(())
}

/// up.sh and down.sh on a registry of their own (next to the shared one): it answers,
/// down.sh stops both processes by pid and removes the directory, and a second down.sh
/// is a no-op.
#[test]
fn up_and_down_leave_nothing_running() -> Result<()> {
    let (port, _) = Registry::placement();
    // Inside the band of six ports this process's placement owns (like the control
    // plane's +0..+5), clear of the shared registry's +0 and +1.
    let port = port + 4;
    let dir = tempdir("updown")?;
    let state = dir.join("registry");
    let env = |cmd: &mut Command| {
        cmd.env("RAMIFY_REGISTRY_DIR", &state)
            .env("RAMIFY_REGISTRY_PORT", port.to_string());
    };
    let root = ramify_e2e::repo_root();
    let mut up = Command::new(root.join("hack/registry/up.sh"));
    env(&mut up);
    let addr = ok(&mut up)?;
    assert_eq!(addr, format!("127.0.0.1:{port}"));
    assert_eq!(http_status(&format!("http://{addr}/v2/"), None)?.0, 401);
    let pids: Vec<String> = ["regfront", "registry"]
        .iter()
        .map(|n| {
            std::fs::read_to_string(state.join(format!("run/{n}.pid")))
                .map(|p| p.trim().to_string())
        })
        .collect::<std::io::Result<_>>()?;
    // Up again while healthy: the same processes.
    let mut again = Command::new(root.join("hack/registry/up.sh"));
    env(&mut again);
    ok(&mut again)?;
    assert_eq!(
        std::fs::read_to_string(state.join("run/regfront.pid"))?.trim(),
        pids[0]
    );
    for _ in 0..2 {
        let mut down = Command::new(root.join("hack/registry/down.sh"));
        env(&mut down);
        ok(&mut down)?;
        for pid in &pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists(),
                "pid {pid} still running"
            );
        }
        assert!(!state.exists(), "down.sh left {}", state.display());
        let refused = output(Command::new("curl").args([
            "-s",
            "--max-time",
            "2",
            &format!("http://{addr}/v2/"),
        ]))?;
        assert!(
            !refused.status.success(),
            "something still answers on {addr}"
        );
    }
    Ok(())
}

/// The size of bin/busybox in the base layer (the setuid image carries copies of it).
fn base_entry_size(reg: &Registry, base: &str, scratch: &Path) -> Result<u64> {
    let busybox = reg.image("busybox:1")?;
    let entries = layer_entries(reg, &busybox.reference, base, scratch)?;
    match entries.iter().find(|e| e.0 == "bin/busybox") {
        Some(e) => Ok(e.4),
        None => bail!("no bin/busybox in the base layer"),
    }
}

#[test]
fn workspace_image_is_debian_with_python_and_sqlite() -> Result<()> {
    let reg = Registry::shared()?;
    let ws = reg.image("workspace:py")?;
    let m = manifest(&reg, &ws.reference)?;
    let layers = layer_digests(&m);
    assert_eq!(layers.len(), 2, "{m}");
    let scratch = tempdir("workspace")?;
    let rootfs = layer_entries(&reg, &ws.reference, &layers[0], &scratch)?;
    let names: BTreeSet<&str> = rootfs.iter().map(|e| e.0.as_str()).collect();
    for want in [
        "usr/bin/python3",
        "usr/bin/sqlite3",
        "etc/debian_version",
        "usr/bin/sleep",
        "dev",
        "tmp",
    ] {
        assert!(
            names.contains(want),
            "{want} missing from the workspace rootfs"
        );
    }
    assert!(
        rootfs
            .iter()
            .all(|e| e.1 != '3' && e.1 != '4' && e.1 != '6'),
        "no device nodes or fifos in the workspace rootfs"
    );
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("dev/") || n.starts_with("proc/")),
        "/dev and /proc are empty"
    );
    // Hard links point at an entry that comes earlier in the same layer.
    let mut seen = BTreeSet::new();
    for e in &rootfs {
        if e.1 == '1' {
            assert!(
                seen.contains(e.3.as_str()),
                "hard link {} -> {} before its target",
                e.0,
                e.3
            );
        }
        seen.insert(e.0.as_str());
    }
    let config = json(&ok(reg.crane()?.args(["config", &ws.reference]))?)?;
    assert_eq!(
        config["config"]["Cmd"],
        serde_json::json!(["sleep", "infinity"])
    );
    assert_eq!(config["config"]["WorkingDir"], "/work");
    eprintln!("workspace:py {} is {} bytes compressed", ws.digest, ws.size);
    Ok(())
}

#[test]
fn moving_a_tag_keeps_the_old_digest_pullable() -> Result<()> {
    let reg = Registry::shared()?;
    let before = reg.image("busybox:moving")?;
    let v1 = reg.image("busybox:1")?;
    let v2 = reg.image("busybox:v2")?;
    assert_ne!(v1.digest, v2.digest);
    assert_eq!(
        ok(reg.crane()?.args(["digest", &before.reference]))?,
        v1.digest,
        "the tag starts at busybox:1"
    );
    let after = reg.retag_busybox_v2()?;
    assert_eq!(after.digest, v2.digest);
    assert_eq!(
        ok(reg.crane()?.args(["digest", &after.reference]))?,
        v2.digest,
        "the tag moved"
    );
    // The old image is still there by digest (a snapshot's restore pulls exactly that).
    assert_eq!(
        ok(reg.crane()?.args(["digest", &before.by_digest()]))?,
        v1.digest
    );
    let m = manifest(&reg, &after.reference)?;
    let scratch = tempdir("moving")?;
    let top = layer_entries(&reg, &after.reference, &layer_digests(&m)[1], &scratch)?;
    assert!(top.iter().any(|e| e.0 == "etc/ramify-v2"), "{top:?}");
    assert_eq!(
        exported_file(&reg, &after.reference, "etc/ramify-image")?,
        "busybox v2\n"
    );
    assert_eq!(
        exported_file(&reg, &before.by_digest(), "etc/ramify-image")?,
        "busybox v1\n"
    );
    Ok(())
}

/// A scratch directory removed on drop (layer blobs; the workspace one is large).
struct Scratch(std::path::PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir(what: &str) -> Result<Scratch> {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dir = std::env::temp_dir().join(format!("ramify-registry-test-{what}-{}", &id[..8]));
    std::fs::create_dir_all(&dir)?;
    Ok(Scratch(dir))
}
