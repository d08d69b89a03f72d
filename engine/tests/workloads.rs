//! Common workloads, forked, on real runsc with a Debian root (python3, sqlite3; the
//! workspace image's tree, `hack/images/debootstrap.sh`): one Python workspace runs
//! - an HTTP server on 127.0.0.1 and one on `localhost` (resolved by `/etc/hosts`),
//! - a server on a Unix socket,
//! - a `multiprocessing` pool that keeps computing,
//! - a writer thread committing to a SQLite database in WAL mode,
//! - a child process holding one TCP connection over loopback to a server of the parent
//!   process, exchanging a message every 100 ms,
//!
//! and each is checked in the workspace, in every branch of a fork (each branch's
//! servers answering with its own state, everything else still making progress across
//! the checkpoint), and in the workspace after a Full commit of one branch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use common::*;
use ramify_engine::engine::LocalSandbox;

const WORKSPACE: &str = r#"
import http.server, multiprocessing, os, socket, socketserver, sqlite3, threading, time

def state():
    with open("/work/state") as f:
        return f.read().strip()

class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = state().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

def serve_http(host, port):
    http.server.ThreadingHTTPServer((host, port), Page).serve_forever()

class UnixPage(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(state().encode())

def square(n):
    return n * n

def pool_loop():
    pool = multiprocessing.Pool(2)
    n = 0
    while True:
        assert pool.apply(square, (n,)) == n * n
        n += 1
        with open("/work/mp.tmp", "w") as f:
            f.write(str(n))
        os.replace("/work/mp.tmp", "/work/mp.count")
        time.sleep(0.1)

def writer():
    db = sqlite3.connect("/work/db.sqlite")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE IF NOT EXISTS t (i INTEGER)")
    i = 0
    while True:
        db.execute("INSERT INTO t VALUES (?)", (i,))
        db.commit()
        i += 1
        time.sleep(0.05)

def echo_server(listener):
    conn, _ = listener.accept()
    while True:
        data = conn.recv(64)
        if not data:
            return
        conn.sendall(data)

def tcp_client(port):
    s = socket.create_connection(("127.0.0.1", port))
    n = 0
    while True:
        s.sendall(b"ping")
        assert s.recv(64) == b"ping"
        n += 1
        with open("/work/tcp.tmp", "w") as f:
            f.write(str(n))
        os.replace("/work/tcp.tmp", "/work/tcp.count")
        time.sleep(0.1)

if __name__ == "__main__":
    os.makedirs("/work", exist_ok=True)
    with open("/work/state", "w") as f:
        f.write("parent")
    threading.Thread(target=serve_http, args=("127.0.0.1", 8000), daemon=True).start()
    threading.Thread(target=serve_http, args=("localhost", 8001), daemon=True).start()
    unix = socketserver.ThreadingUnixStreamServer("/work/app.sock", UnixPage)
    threading.Thread(target=unix.serve_forever, daemon=True).start()
    threading.Thread(target=pool_loop, daemon=True).start()
    threading.Thread(target=writer, daemon=True).start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 8002))
    listener.listen(1)
    threading.Thread(target=echo_server, args=(listener,), daemon=True).start()
    multiprocessing.Process(target=tcp_client, args=(8002,), daemon=True).start()
    open("/work/ready", "w").close()
    while True:
        time.sleep(1)
"#;

/// Prints one JSON object: what each server answers, and whether the pool, the SQLite
/// writer and the held TCP connection made progress over one second.
const CHECK: &str = r#"
import json, socket, sqlite3, time, urllib.request
def get(url):
    return urllib.request.urlopen(url, timeout=5).read().decode()
def unix():
    s = socket.socket(socket.AF_UNIX)
    s.connect("/work/app.sock")
    return s.recv(64).decode()
def count(path):
    with open(path) as f:
        return int(f.read() or 0)
def rows():
    db = sqlite3.connect("/work/db.sqlite", timeout=5)
    n = db.execute("SELECT count(*) FROM t").fetchone()[0]
    ok = db.execute("PRAGMA integrity_check").fetchone()[0]
    mode = db.execute("PRAGMA journal_mode").fetchone()[0]
    db.close()
    return n, ok, mode
before = (count("/work/mp.count"), count("/work/tcp.count"), rows()[0])
time.sleep(1)
n, ok, mode = rows()
print(json.dumps({
    "http_127": get("http://127.0.0.1:8000/"),
    "http_localhost": get("http://localhost:8001/"),
    "unix": unix(),
    "pool_moves": count("/work/mp.count") > before[0],
    "tcp_moves": count("/work/tcp.count") > before[1],
    "sqlite_moves": n > before[2],
    "sqlite_integrity": ok,
    "sqlite_mode": mode,
}))
"#;

/// The workspace image's Debian tree, unpacked into the harness's own roots.
fn debian_root(h: &Harness) -> PathBuf {
    // The manifest directory at run time: the binary may have been built in another clone.
    let script = Path::new(
        &std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR (run under cargo test)"),
    )
    .join("../hack/images/debootstrap.sh");
    let out = std::process::Command::new(&script).output().unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let tar = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let root = h.dir.join(ROOTS).join("debian");
    std::fs::create_dir_all(&root).unwrap();
    let st = std::process::Command::new("tar")
        .args(["-xf", &tar, "-C"])
        .arg(&root)
        .status()
        .unwrap();
    assert!(st.success(), "unpacking {tar}");
    // ramify's mount points (an image's composed root gets them the same way).
    std::fs::create_dir_all(root.join("run/ramify")).unwrap();
    std::fs::create_dir_all(root.join("work")).unwrap();
    for f in ["hosts", "hostname", "resolv.conf"] {
        let p = root.join("etc").join(f);
        if std::fs::symlink_metadata(&p).is_err() {
            std::fs::write(&p, "").unwrap();
        }
    }
    root
}

/// The workspace's checks, answered with `want` by its servers.
async fn works(h: &Harness, sb: &LocalSandbox, want: &str) {
    let mut last = String::new();
    poll_until(
        &format!("{} serving {want:?} and making progress", sb.name),
        60,
        async || {
            let out = h
                .engine
                .exec(sb, &["/usr/bin/python3", "-c", CHECK])
                .await
                .unwrap_or_else(|e| panic!("exec: {e}"));
            last = format!("{} {}", out.stdout_str(), out.stderr_str());
            let Ok(v) = serde_json::from_str::<serde_json::Value>(out.stdout_str().trim()) else {
                return false;
            };
            v["http_127"] == want
                && v["http_localhost"] == want
                && v["unix"] == want
                && v["pool_moves"] == true
                && v["tcp_moves"] == true
                && v["sqlite_moves"] == true
                && v["sqlite_integrity"] == "ok"
                && v["sqlite_mode"] == "wal"
        },
    )
    .await;
    eprintln!("{}: {}", sb.name, last.trim());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_pools_sqlite_wal_and_a_held_connection_work_in_every_branch_and_after_commit() {
    let h = harness("workloads").await;
    let root = debian_root(&h);
    let mut parent = h
        .start_from(
            "parent",
            &root,
            &format!(
                "exec /usr/bin/python3 -c '{}'",
                WORKSPACE.replace('\'', "'\\''")
            ),
            vec![],
        )
        .await;
    poll_until("the workspace is up", 60, async || {
        h.engine
            .exec(&parent, &["test", "-e", "/work/ready"])
            .await
            .is_ok_and(|o| o.code == 0)
    })
    .await;
    works(&h, &parent, "parent").await;

    let snap = h
        .engine
        .snapshot(&mut parent, None)
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}"));
    let mut branches = h.fork_n(&snap.meta.id, 2).await;
    for b in &branches {
        h.sh(b, &format!("echo {} > /work/state", b.name)).await;
    }
    for b in &branches {
        works(&h, b, &b.name).await;
    }
    works(&h, &parent, "parent").await;

    // A Full commit: the winner's processes and files are the workspace's now.
    let winner = branches.remove(0);
    let name = winner.name.clone();
    h.engine.commit_full(&mut parent, winner).await.unwrap();
    works(&h, &parent, &name).await;
    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}
