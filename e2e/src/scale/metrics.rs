//! What the scale run measures: the operator's metrics (reconcile durations, failures),
//! the API server's requests by user, verb and resource, and the processes' memory and CPU.

use super::*;

/// A port nothing listens on now (the operator's metrics endpoint).
pub(super) fn free_port() -> Result<u16, ScaleError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err("finding a free port"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(io_err("finding a free port"))
}

/// `GET /metrics` of the operator (plain HTTP on loopback).
pub(super) async fn operator_metrics(port: u16) -> Result<String, ScaleError> {
    let what = || format!("reading the operator's metrics on 127.0.0.1:{port}");
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(io_err(what()))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .map_err(io_err(what()))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.map_err(io_err(what()))?;
    let text = String::from_utf8_lossy(&buf);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_string()),
        _ => Err(ScaleError::Check(format!(
            "{}: unexpected answer {:?}",
            what(),
            text.chars().take(200).collect::<String>()
        ))),
    }
}

/// Waits until the operator serves its metrics; returns them.
pub(super) async fn wait_for_metrics(
    port: u16,
    operator: &mut Component,
) -> Result<String, ScaleError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match operator_metrics(port).await {
            Ok(m) => return Ok(m),
            Err(e) if Instant::now() > deadline || !operator.running() => {
                return Err(ScaleError::Check(format!(
                    "the operator never served its metrics ({e})\n--- operator log ---\n{}",
                    operator.log_tail(30)
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

pub(super) fn apiserver_pid(cp: &ControlPlane) -> Result<u32, ScaleError> {
    let path = cp.dir.join("run/kube-apiserver.pid");
    std::fs::read_to_string(&path)
        .map_err(io_err(format!("reading {}", path.display())))?
        .trim()
        .parse()
        .map_err(|e| ScaleError::Check(format!("{}: {e}", path.display())))
}

/// VmRSS, VmHWM and utime + stime of `pid` (zeros for what cannot be read).
pub(super) fn process(pid: u32) -> ProcessFigures {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // Fields 14 and 15 after the command name, in clock ticks (USER_HZ, 100 on Linux).
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let ticks: f64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|v| v.parse::<f64>().ok())
                .sum()
        })
        .unwrap_or(0.0);
    ProcessFigures {
        rss_kib: kib("VmRSS:"),
        hwm_kib: kib("VmHWM:"),
        cpu_seconds: ticks / 100.0,
    }
}

pub(super) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// One sample of a Prometheus text exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> &str {
        self.labels.get(key).map(String::as_str).unwrap_or_default()
    }
}

/// Parses the Prometheus text format (comments skipped; label values unescaped).
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(i) => {
                let mut labels = BTreeMap::new();
                let mut chars = line[i + 1..].char_indices();
                let mut key = String::new();
                let mut end = None;
                while let Some((j, c)) = chars.next() {
                    match c {
                        '}' => {
                            end = Some(i + 1 + j + 1);
                            break;
                        }
                        ',' | ' ' => {}
                        '=' => {
                            // A quoted value follows.
                            let _ = chars.next();
                            let mut value = String::new();
                            while let Some((_, c)) = chars.next() {
                                match c {
                                    '\\' => match chars.next().map(|(_, c)| c) {
                                        Some('n') => value.push('\n'),
                                        Some(c) => value.push(c),
                                        None => {}
                                    },
                                    '"' => break,
                                    c => value.push(c),
                                }
                            }
                            labels.insert(std::mem::take(&mut key), value);
                        }
                        c => key.push(c),
                    }
                }
                let Some(end) = end else { continue };
                (&line[..i], labels, &line[end..])
            }
            None => match line.split_once(' ') {
                Some((n, rest)) => (n, BTreeMap::new(), rest),
                None => continue,
            },
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    out
}

/// The API server's request counters at one instant.
pub(super) struct ApiSample {
    pub(super) by_verb_resource: BTreeMap<String, f64>,
    pub(super) by_client: BTreeMap<String, f64>,
    pub(super) refused: BTreeMap<String, f64>,
}

impl ApiSample {
    pub(super) async fn take(admin: &Client) -> Result<ApiSample, ScaleError> {
        let req = http::Request::get("/metrics")
            .body(Vec::new())
            .map_err(|e| ScaleError::Check(format!("building GET /metrics: {e}")))?;
        let text = admin
            .request_text(req)
            .await
            .map_err(api_call("reading the API server's /metrics"))?;
        let mut by_verb_resource = BTreeMap::new();
        let mut by_client = BTreeMap::new();
        let mut refused = BTreeMap::new();
        for s in parse_prometheus(&text) {
            match s.name.as_str() {
                "apiserver_request_total" => {
                    let mut key = format!("{} {}", s.label("verb"), s.label("resource"));
                    if !s.label("subresource").is_empty() {
                        key = format!("{key}/{}", s.label("subresource"));
                    }
                    if !s.label("code").starts_with('2') {
                        *refused
                            .entry(format!("{} {key}", s.label("code")))
                            .or_insert(0.0) += s.value;
                    }
                    *by_verb_resource.entry(key).or_insert(0.0) += s.value;
                }
                "apiserver_flowcontrol_dispatched_requests_total" => {
                    *by_client
                        .entry(s.label("flow_schema").to_string())
                        .or_insert(0.0) += s.value;
                }
                _ => {}
            }
        }
        Ok(ApiSample {
            by_verb_resource,
            by_client,
            refused,
        })
    }

    pub(super) fn minus(&self, before: &ApiSample) -> ApiRequests {
        let diff = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            a.iter()
                .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect::<BTreeMap<_, _>>()
        };
        let by_verb_resource = diff(&self.by_verb_resource, &before.by_verb_resource);
        ApiRequests {
            total: by_verb_resource.values().sum(),
            by_verb_resource,
            by_client: diff(&self.by_client, &before.by_client),
            refused: diff(&self.refused, &before.refused),
        }
    }
}

/// Per controller: the reconciles between two samples of the operator's metrics, and
/// the quantiles their `reconcile_duration_seconds` buckets bound.
pub fn reconcile_figures(before: &str, after: &str) -> Vec<ReconcileFigures> {
    // controller -> (le -> cumulative count, count, sum)
    type Hist = BTreeMap<String, (Vec<(f64, f64)>, f64, f64)>;
    pub(super) fn hist(text: &str) -> Hist {
        let mut h: Hist = BTreeMap::new();
        for s in parse_prometheus(text) {
            let Some(part) = s
                .name
                .strip_prefix("ramify_operator_reconcile_duration_seconds_")
            else {
                continue;
            };
            let e = h.entry(s.label("controller").to_string()).or_default();
            match part {
                "bucket" => {
                    let le = match s.label("le") {
                        "+Inf" => f64::INFINITY,
                        v => v.parse().unwrap_or(f64::INFINITY),
                    };
                    e.0.push((le, s.value));
                }
                "count" => e.1 = s.value,
                "sum" => e.2 = s.value,
                _ => {}
            }
        }
        h
    }
    let (b, a) = (hist(before), hist(after));
    let mut out = Vec::new();
    for (controller, (buckets, count, sum)) in a {
        let (bb, bc, bs) = b.get(&controller).cloned().unwrap_or_default();
        let runs = count - bc;
        if runs <= 0.0 {
            continue;
        }
        let mut buckets: Vec<(f64, f64)> = buckets
            .iter()
            .map(|(le, n)| {
                let was = bb
                    .iter()
                    .find(|(l, _)| l == le)
                    .map(|(_, n)| *n)
                    .unwrap_or(0.0);
                (*le, n - was)
            })
            .collect();
        buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
        let quantile = |q: f64| {
            buckets
                .iter()
                .find(|(_, n)| *n >= q * runs)
                .map(|(le, _)| *le)
                .unwrap_or(f64::INFINITY)
        };
        out.push(ReconcileFigures {
            controller,
            runs,
            p50_le: quantile(0.50),
            p99_le: quantile(0.99),
            mean: (sum - bs) / runs,
        });
    }
    out
}

/// Per `controller error`: the failed reconciles between two samples.
pub(super) fn failures(before: &str, after: &str) -> BTreeMap<String, f64> {
    let count = |text: &str| {
        let mut m = BTreeMap::new();
        for s in parse_prometheus(text) {
            if s.name == "ramify_operator_reconcile_failures_total" {
                let key = format!("{} {}", s.label("controller"), s.label("error"));
                *m.entry(key).or_insert(0.0) += s.value;
            }
        }
        m
    };
    let b = count(before);
    count(after)
        .into_iter()
        .map(|(k, v)| {
            let was = b.get(&k).copied().unwrap_or(0.0);
            (k, v - was)
        })
        .filter(|(_, v)| *v > 0.0)
        .collect()
}
