//! `kubectl ramify logs`: a Pod log's query (`follow`, `tailLines`, `sinceSeconds`,
//! `sinceTime`) from kubectl's own flags (`-f`, `--tail`, `--since`, `--since-time`).

use crate::{Error, Result};

/// `--since`'s duration as a count of seconds, as kubectl takes it: one or more
/// `<number><unit>` with units `h`, `m` and `s` (`90s`, `5m`, `1h30m`), rounded up to
/// a whole second and at least one.
pub fn since_seconds(s: &str) -> Result<u64> {
    let bad = || {
        Error::Usage(format!(
            "--since wants a duration like 30s, 5m or 1h30m, not {s:?}"
        ))
    };
    let mut total = 0u64;
    let mut digits = String::new();
    let mut any = false;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match (c, chars.peek()) {
            ('m', Some('s')) => {
                chars.next();
                0 // milliseconds: rounded up below
            }
            ('h', _) => 3600,
            ('m', _) => 60,
            ('s', _) => 1,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        digits.clear();
        total = total
            .checked_add(if unit == 0 {
                n.div_ceil(1000)
            } else {
                n.checked_mul(unit).ok_or_else(bad)?
            })
            .ok_or_else(bad)?;
        any = true;
    }
    if !digits.is_empty() || !any {
        return Err(bad());
    }
    Ok(total.max(1))
}

/// The log request's query.
pub fn query(
    follow: bool,
    tail: Option<u64>,
    since: Option<&str>,
    since_time: Option<&str>,
) -> Result<Vec<(&'static str, String)>> {
    let mut q = Vec::new();
    if follow {
        q.push(("follow", "true".to_string()));
    }
    if let Some(n) = tail {
        q.push(("tailLines", n.to_string()));
    }
    match (since, since_time) {
        (Some(_), Some(_)) => {
            return Err(Error::Usage(
                "--since and --since-time cannot be given together".into(),
            ));
        }
        (Some(d), None) => q.push(("sinceSeconds", since_seconds(d)?.to_string())),
        (None, Some(t)) => {
            // Checked here for a message that names the flag; the endpoint checks again.
            t.parse::<k8s_openapi::jiff::Timestamp>().map_err(|e| {
                Error::Usage(format!(
                    "--since-time wants an RFC 3339 time like 2026-12-07T17:00:00Z, not {t:?}: {e}"
                ))
            })?;
            q.push(("sinceTime", t.to_string()));
        }
        (None, None) => {}
    }
    Ok(q)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn durations_as_kubectl_takes_them() {
        assert_eq!(since_seconds("30s").unwrap(), 30);
        assert_eq!(since_seconds("5m").unwrap(), 300);
        assert_eq!(since_seconds("1h30m").unwrap(), 5400);
        assert_eq!(since_seconds("1500ms").unwrap(), 2);
        assert_eq!(since_seconds("0s").unwrap(), 1);
        for bad in [
            "",
            "5",
            "m",
            "5x",
            "-5s",
            "1.5h",
            "5s ",
            "99999999999999999999h",
        ] {
            assert!(
                matches!(since_seconds(bad), Err(Error::Usage(m)) if m.contains("--since")),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_query_is_a_pod_logs() {
        assert_eq!(
            query(true, Some(3), Some("2m"), None).unwrap(),
            vec![
                ("follow", "true".to_string()),
                ("tailLines", "3".to_string()),
                ("sinceSeconds", "120".to_string())
            ]
        );
        assert_eq!(
            query(false, None, None, Some("2026-12-07T17:00:00Z")).unwrap(),
            vec![("sinceTime", "2026-12-07T17:00:00Z".to_string())]
        );
        assert!(matches!(
            query(false, None, Some("1m"), Some("2026-12-07T17:00:00Z")),
            Err(Error::Usage(_))
        ));
        assert!(matches!(
            query(false, None, None, Some("noon")),
            Err(Error::Usage(m)) if m.contains("--since-time")
        ));
    }
}
