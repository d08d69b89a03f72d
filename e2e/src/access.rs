//! Access through Kubernetes for tests: ramify-api as a real process registered with
//! the test control plane as the aggregated API `subresources.ramify.dev`
//! (`hack/apiservice.sh`), certificates from `hack/pki.sh`, and users with client
//! certificates signed by the control plane's client CA, each with a kubeconfig of
//! their own. Test support: failures panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{Component, ControlPlane, binary, repo_root};

/// The name of the APIService (cluster-wide: one per control plane at a time).
pub const API_SERVICE: &str = "v1alpha1.subresources.ramify.dev";

/// The port ramify-api listens on in tests: the control plane's port base + 6, so
/// concurrent runs on other port bases never collide.
pub fn api_port() -> u16 {
    let base: u16 = std::env::var("RAMIFY_CP_PORT_BASE")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(16440);
    base + 6
}

/// Makes (or keeps) the certificates of ramify-api and the agent endpoint in `dir`
/// for a ramify installed in `namespace`.
pub fn pki(dir: &Path, namespace: &str) -> PathBuf {
    let out = Command::new(repo_root().join("hack/pki.sh"))
        .arg(dir)
        .arg(namespace)
        .output()
        .expect("hack/pki.sh");
    assert!(
        out.status.success(),
        "hack/pki.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.to_path_buf()
}

/// ramify-api running and registered; dropping it stops it and removes the
/// APIService (an APIService without a backend stalls namespace deletion).
pub struct ApiServer {
    pub component: Component,
    pub port: u16,
    cp: ControlPlane,
}

impl ApiServer {
    /// Starts ramify-api for the system namespace `system_ns` (whose Leases announce
    /// the agents' endpoints) with the certificates in `pki`, registers it, and waits
    /// until the API server reports the APIService Available.
    pub fn start(cp: &ControlPlane, system_ns: &str, pki: &Path, log_dir: &Path) -> ApiServer {
        let port = api_port();
        let p = |f: &str| pki.join(f).to_string_lossy().into_owned();
        let mut component = Component::new(
            "ramify-api",
            binary("ramify-api").unwrap(),
            vec![
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--tls-cert".into(),
                p("api-serving.crt"),
                "--tls-key".into(),
                p("api-serving.key"),
                "--agent-ca".into(),
                p("ca.crt"),
                "--agent-client-cert".into(),
                p("api-client.crt"),
                "--agent-client-key".into(),
                p("api-client.key"),
                "--system-namespace".into(),
                system_ns.into(),
            ],
            vec![(
                "KUBECONFIG".into(),
                cp.kubeconfig.to_string_lossy().into_owned(),
            )],
            log_dir,
        );
        component.start().unwrap();
        let manifests = Command::new(repo_root().join("hack/apiservice.sh"))
            .args([system_ns, &port.to_string(), &p("ca.crt")])
            .output()
            .unwrap();
        assert!(
            manifests.status.success(),
            "hack/apiservice.sh: {}",
            String::from_utf8_lossy(&manifests.stderr)
        );
        let out = cp
            .kubectl_run(
                &["apply", "-f", "-"],
                Some(&String::from_utf8_lossy(&manifests.stdout)),
            )
            .unwrap();
        assert!(out.success, "registering ramify-api: {}", out.stderr);
        let server = ApiServer {
            component,
            port,
            cp: cp.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = cp
                .kubectl_run(
                    &[
                        "get",
                        "apiservice",
                        API_SERVICE,
                        "-o",
                        r#"jsonpath={.status.conditions[?(@.type=="Available")].status} {.status.conditions[?(@.type=="Available")].message}"#,
                    ],
                    None,
                )
                .unwrap();
            if out.stdout.starts_with("True") {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "APIService {API_SERVICE} not Available within 60s: {}{}\n--- ramify-api log ---\n{}",
                out.stdout,
                out.stderr,
                server.component.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.component.kill();
        let _ = self.cp.kubectl_run(
            &[
                "delete",
                "apiservice",
                API_SERVICE,
                "--ignore-not-found",
                "--wait=false",
            ],
            None,
        );
    }
}

impl ControlPlane {
    /// A kubeconfig for `user` (in `groups`) authenticated by a client certificate
    /// signed by this control plane's client CA, written under `dir`.
    pub fn user_kubeconfig(&self, user: &str, groups: &[&str], dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let pki = self.dir.join("pki");
        let key = dir.join(format!("{user}.key"));
        let csr = dir.join(format!("{user}.csr"));
        let crt = dir.join(format!("{user}.crt"));
        let ext = dir.join(format!("{user}.ext"));
        let subj: String = groups
            .iter()
            .map(|g| format!("/O={g}"))
            .chain([format!("/CN={user}")])
            .collect();
        std::fs::write(
            &ext,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("openssl").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let s = |p: &Path| p.to_string_lossy().into_owned();
        run(&["genrsa", "-out", &s(&key), "2048"]);
        run(&[
            "req",
            "-new",
            "-key",
            &s(&key),
            "-subj",
            &subj,
            "-out",
            &s(&csr),
        ]);
        run(&[
            "x509",
            "-req",
            "-in",
            &s(&csr),
            "-CA",
            &s(&pki.join("ca.crt")),
            "-CAkey",
            &s(&pki.join("ca.key")),
            "-CAcreateserial",
            "-CAserial",
            &s(&dir.join("ca.srl")),
            "-days",
            "1",
            "-extfile",
            &s(&ext),
            "-out",
            &s(&crt),
        ]);
        let server = std::fs::read_to_string(&self.kubeconfig)
            .unwrap()
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: ").map(str::to_string))
            .expect("server in the admin kubeconfig");
        let kubeconfig = dir.join(format!("{user}.kubeconfig"));
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: ramify\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: {user}\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: ramify\n  context: {{cluster: ramify, user: {user}, namespace: default}}\ncurrent-context: ramify\n",
                s(&pki.join("ca.crt")),
                s(&crt),
                s(&key)
            ),
        )
        .unwrap();
        kubeconfig
    }
}

/// `kubectl ramify port-forward SANDBOX :PORT` as `kubeconfig`'s user, running: the
/// child and the local port it listens on.
pub fn port_forward(
    kubeconfig: &Path,
    ns: &str,
    sandbox: &str,
    port: u16,
) -> (std::process::Child, u16) {
    let mut child = Command::new(binary("kubectl-ramify").unwrap())
        .args(["-n", ns, "port-forward", sandbox, &format!(":{port}")])
        .env("KUBECONFIG", kubeconfig)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    // "Forwarding from 127.0.0.1:LOCAL -> PORT"
    let local = first
        .strip_prefix("Forwarding from 127.0.0.1:")
        .and_then(|r| r.split_once(' '))
        .and_then(|(p, rest)| (rest == format!("-> {port}")).then(|| p.parse().ok())?)
        .unwrap_or_else(|| panic!("port-forward printed {first:?}"));
    (child, local)
}

/// `GET /index.html` on `127.0.0.1:local`: the body, trimmed (or the failure).
pub async fn get_page(local: u16) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", local))
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut resp))
        .await
        .map_err(|_| "no answer in 20 s".to_string())?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&resp).into_owned();
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") => Ok(body.trim().to_string()),
        _ => Err(format!("not an HTTP response: {text:?}")),
    }
}

/// Waits until `127.0.0.1:local` serves `want`.
pub async fn serves(local: u16, want: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = get_page(local).await;
        if got.as_deref() == Ok(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: last answer {got:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
