//! Port-forward into a sandbox on real runsc: a connection to a server on the
//! sandbox's loopback and to one on all its addresses, byte for byte for 10 MiB, twenty
//! at once, a clear refusal where nothing listens, each branch of a fork reached on its
//! own, a paused branch reached while looks hold it (two at once, the last one pausing
//! it again; the agent's own pause and resume never wait for a look), and a clear error from a runsc
//! that cannot (Debian's, with an abstract control socket).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use ramify_engine::engine::LocalSandbox;
use ramify_engine::freezer::{self, Depth};
use ramify_engine::runsc::RunscConfig;
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Busybox web servers serving /www: one on loopback only, one on every address, and a
/// 10 MiB file of random bytes with its sha256 beside it; then idle.
const SERVE: &str = "mkdir -p /www && echo parent > /www/index.html && \
    head -c 10485760 /dev/urandom > /www/big && sha256sum /www/big | cut -d' ' -f1 > /www/big.sha256 && \
    httpd -p 127.0.0.1:8000 -h /www && httpd -p 8002 -h /www && while true; do sleep 1; done";

/// `GET /<path>` through a port-forward to `port`: the response's body, or the error.
async fn get(h: &Harness, sb: &LocalSandbox, port: u16, path: &str) -> Result<Vec<u8>, String> {
    let mut s = h
        .engine
        .port_forward(sb, port)
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(format!("GET /{path} HTTP/1.0\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await.map_err(|e| e.to_string())?;
    let at = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no HTTP response: {:?}", String::from_utf8_lossy(&resp)))?;
    Ok(resp[at + 4..].to_vec())
}

async fn page(h: &Harness, sb: &LocalSandbox, port: u16) -> Result<String, String> {
    get(h, sb, port, "index.html")
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
}

/// Waits until `sb` serves `want` on both ports through port-forwards.
async fn serves(h: &Harness, sb: &LocalSandbox, want: &str) {
    for port in [8000, 8002] {
        let mut last = Err(String::new());
        poll_until(
            &format!(
                "{} serving {want:?} on port {port} (last: {last:?})",
                sb.name
            ),
            30,
            async || {
                last = page(h, sb, port).await;
                last.as_deref() == Ok(want)
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_reaches_a_sandboxs_servers_and_each_branchs_own() {
    let h = harness_with(
        "port-forward",
        RunscConfig {
            binary: current_runsc(),
            ..RunscConfig::default()
        },
        None,
    )
    .await;
    let mut parent = h.start("parent", SERVE, vec![]).await;
    serves(&h, &parent, "parent").await;

    // Nothing listens on port 9: refused at once, and saying so.
    let refused = page(&h, &parent, 9).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains("nothing accepts connections on port 9")),
        "{refused:?}"
    );

    // 10 MiB, byte for byte (its sha256 as the sandbox computed it).
    let want = h
        .sh(&parent, "cat /www/big.sha256")
        .await
        .trim()
        .to_string();
    let t0 = std::time::Instant::now();
    let big = get(&h, &parent, 8002, "big").await.unwrap();
    eprintln!("10 MiB through a port-forward in {:?}", t0.elapsed());
    assert_eq!(big.len(), 10 << 20);
    assert_eq!(format!("{:x}", sha2::Sha256::digest(&big)), want);

    // What a connection costs: the call that connects it, one after another (paced:
    // busybox httpd forks per connection, and back to back its small accept backlog
    // fills, so one SYN in twenty waits for netstack's 1 s retransmission).
    let mut setup = Vec::new();
    for _ in 0..20 {
        let t0 = std::time::Instant::now();
        let c = h.engine.port_forward(&parent, 8002).await.unwrap();
        setup.push(t0.elapsed());
        drop(c);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    setup.sort();
    eprintln!(
        "port-forward connection set-up: median {:?}, max {:?} (20 in a row)",
        setup[setup.len() / 2],
        setup[setup.len() - 1]
    );

    // Twenty connections at once, each answered whole.
    let pages = futures::future::join_all((0..20).map(|i| {
        let (h, parent) = (&h, &parent);
        async move { page(h, parent, if i % 2 == 0 { 8000 } else { 8002 }).await }
    }))
    .await;
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(p.as_deref(), Ok("parent"), "connection {i}");
    }

    // Each branch of a fork: its servers kept listening, and a port-forward reaches its
    // own (it answers with its own file), not its parent's nor its sibling's.
    let branches = h.snapshot_and_fork(&mut parent, 2).await;
    for b in &branches {
        h.sh(b, &format!("echo {} > /www/index.html", b.name)).await;
    }
    for b in &branches {
        serves(&h, b, &b.name).await;
    }
    serves(&h, &parent, "parent").await;

    // A paused (decided) branch answers while a look holds it, and is paused again after.
    let b0 = &branches[0];
    let runsc = h.engine.runsc().clone();
    freezer::pause(&runsc, b0.ctx(), &b0.dir, b0.cgroups_path(), Depth::Pause)
        .await
        .unwrap();
    // Two looks at once (an exec and a connection, or two connections) share it: the
    // second does not wait for the first, and the last one pauses it again.
    let first = h.engine.look(b0).await.unwrap();
    let second = tokio::time::timeout(std::time::Duration::from_secs(5), h.engine.look(b0))
        .await
        .expect("a second look waited for the first")
        .unwrap();
    assert!(!freezer::is_paused(&b0.dir));
    assert_eq!(page(&h, b0, 8000).await.as_deref(), Ok(b0.name.as_str()));
    first.end().await.unwrap();
    assert!(
        !freezer::is_paused(&b0.dir),
        "paused while a look was still open"
    );
    assert_eq!(page(&h, b0, 8000).await.as_deref(), Ok(b0.name.as_str()));
    second.end().await.unwrap();
    assert!(freezer::is_paused(&b0.dir));

    // The agent never waits for a look. Its resume (a commit) during one: the branch
    // runs already, and the look's end does not pause it again.
    let look = h.engine.look(b0).await.unwrap();
    let t0 = std::time::Instant::now();
    let done = freezer::resume_over_looks(&runsc, b0.ctx(), &b0.dir, b0.cgroups_path())
        .await
        .unwrap();
    assert_eq!(done, freezer::Outcome::Deferred);
    look.end().await.unwrap();
    assert!(
        !freezer::is_paused(&b0.dir),
        "a look paused a committed branch"
    );
    // Its pause (a verdict) during a connection: the connection goes on, and its end
    // pauses the branch.
    let look = h.engine.look(b0).await.unwrap();
    let mut conn = h.engine.port_forward(b0, 8000).await.unwrap();
    let done =
        freezer::pause_over_looks(&runsc, b0.ctx(), &b0.dir, b0.cgroups_path(), Depth::Pause)
            .await
            .unwrap();
    assert_eq!(done, freezer::Outcome::Deferred);
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(2),
        "the agent waited {:?} for looks",
        t0.elapsed()
    );
    conn.write_all(b"GET /index.html HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut resp = Vec::new();
    conn.read_to_end(&mut resp).await.unwrap();
    assert!(String::from_utf8_lossy(&resp).ends_with(&format!("{}\n", b0.name)));
    assert!(!freezer::is_paused(&b0.dir));
    look.end().await.unwrap();
    assert!(
        freezer::is_paused(&b0.dir),
        "the last look did not pause it"
    );
    // With no look: done at once.
    let done = freezer::resume_over_looks(&runsc, b0.ctx(), &b0.dir, b0.cgroups_path())
        .await
        .unwrap();
    assert_eq!(done, freezer::Outcome::Done);
    assert!(!freezer::is_paused(&b0.dir));

    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runsc_without_a_control_socket_file_says_port_forward_needs_the_pinned_one() {
    // Debian's runsc (the harness's default: RAMIFY_RUNSC or the one on PATH) keeps its
    // control socket abstract, in the sandbox's network namespace.
    let h = harness("port-forward-debian").await;
    let sb = h.start("old", "while true; do sleep 1; done", vec![]).await;
    let r = page(&h, &sb, 8000).await;
    if h.engine.runsc().version().contains("20221219") {
        assert!(
            r.as_ref()
                .is_err_and(|e| e.contains("port-forward needs the pinned runsc")),
            "{r:?}"
        );
    } else {
        // The current runsc (the suite's second run): nothing listens there.
        assert!(
            r.as_ref()
                .is_err_and(|e| e.contains("nothing accepts connections on port 8000")),
            "{r:?}"
        );
    }
    h.destroy_clean(sb).await;
    h.finish().await;
}
