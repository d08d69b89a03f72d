//! The port-forward scenario (`--scenarios portforward`): a request through a
//! port-forward into a sandbox, made `--pf-requests` times one after another, the
//! engine's way (one call on the sandbox's control socket per connection) next to
//! the way by hand (`runsc port-forward --stream`, a runsc process per connection,
//! handing the sandbox a Unix socket the bench listens on). Each request is a
//! `GET` of a 1 KiB page from busybox httpd on the sandbox's loopback, read to its
//! end. Then 10 MiB through one connection, both ways.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ramify_engine::cmd::Cmd;
use ramify_engine::engine::{Engine, LocalSandbox};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{median, ms, start_workload, workload};

/// A GET of `path` over `conn`; the body's length.
async fn get<S: AsyncRead + AsyncWrite + Unpin>(conn: &mut S, path: &str) -> Result<usize> {
    conn.write_all(format!("GET /{path} HTTP/1.0\r\n\r\n").as_bytes())
        .await?;
    let mut resp = Vec::new();
    conn.read_to_end(&mut resp).await?;
    let at = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no HTTP response")?;
    Ok(resp.len() - at - 4)
}

/// A connection to port 8000 of `sb` by hand: `runsc port-forward --stream SOCK`
/// connects to the bench's socket and hands that connection to the sandbox.
async fn by_hand(
    engine: &Engine,
    sb: &LocalSandbox,
    sock: &Path,
) -> Result<tokio::net::UnixStream> {
    let _ = std::fs::remove_file(sock);
    let listener = tokio::net::UnixListener::bind(sock)?;
    let mut argv = engine.runsc().global_args(sb.ctx());
    argv.extend([
        "port-forward".into(),
        "--stream".into(),
        sock.as_os_str().to_owned(),
        sb.ctx().id.clone().into(),
        "8000".into(),
    ]);
    let mut it = argv.into_iter();
    let cmd = Cmd::new(it.next().unwrap_or_default()).args(it);
    let (accepted, ran) = tokio::join!(listener.accept(), cmd.run());
    ran?;
    Ok(accepted?.0)
}

pub async fn run(engine: &Engine, rootfs: &Path, dir: &Path, requests: usize) -> Result<()> {
    let mut w = workload(0);
    w.args = vec![
        "/bin/sh".into(),
        "-c".into(),
        "mkdir -p /www && head -c 1024 /dev/zero > /www/page && \
         head -c 10485760 /dev/urandom > /www/big && httpd -p 127.0.0.1:8000 -h /www && \
         touch /tmp/ready && while true; do sleep 1; done"
            .into(),
    ];
    let sb = start_workload(engine, rootfs, "portforward", w).await?;
    let measured = async {
        let sock = dir.join("pf.sock");
        let (mut ours, mut hand) = (Vec::new(), Vec::new());
        // Alternating, so both see the same machine; paced, so busybox httpd (a fork
        // per connection) keeps up and what is timed is the connection.
        for _ in 0..requests.max(1) {
            let t = Instant::now();
            let mut c = engine.port_forward(&sb, 8000).await?;
            if get(&mut c, "page").await? != 1024 {
                bail!("a short page through the engine's port-forward");
            }
            ours.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(20)).await;
            let t = Instant::now();
            let mut c = by_hand(engine, &sb, &sock).await?;
            if get(&mut c, "page").await? != 1024 {
                bail!("a short page through runsc port-forward");
            }
            hand.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let t = Instant::now();
        let mut c = engine.port_forward(&sb, 8000).await?;
        let big_ours = (get(&mut c, "big").await?, t.elapsed());
        let t = Instant::now();
        let mut c = by_hand(engine, &sb, &sock).await?;
        let big_hand = (get(&mut c, "big").await?, t.elapsed());
        if big_ours.0 != 10 << 20 || big_hand.0 != 10 << 20 {
            bail!("10 MiB came short: {} / {} bytes", big_ours.0, big_hand.0);
        }
        println!();
        println!(
            "## A request through a port-forward (connect, GET 1 KiB, read to the end; medians of {})",
            requests.max(1)
        );
        println!("| | ramify (control socket) | by hand (`runsc port-forward --stream`) |");
        println!("|---|---|---|");
        println!("| connect + GET 1 KiB | {} | {} |", ms(median(ours)), ms(median(hand)));
        println!("| connect + GET 10 MiB | {} | {} |", ms(big_ours.1), ms(big_hand.1));
        anyhow::Ok(())
    }
    .await;
    engine.destroy(sb).await?;
    measured
}
