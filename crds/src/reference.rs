//! The API reference in Markdown (`docs/api-reference.md`), generated from the CRDs'
//! `openAPIV3Schema`: every field's path, type, description (the types' doc comments),
//! and its default, enum, bounds, pattern and CEL validations where it has them.
//! `crdgen --docs FILE` writes it; `crdgen --check-docs FILE` fails when it differs.

use serde_json::Value;
use std::fmt::Write as _;

/// Fields whose schema is an embedded Kubernetes type, listed once, not field by field.
const EMBEDDED: &[(&str, &str)] = &[(
    "affinity",
    "a Kubernetes `Affinity` (core/v1), exactly as on a Pod",
)];

/// The reference for every CRD of the API, in install order.
pub fn api_reference_markdown() -> Result<String, serde_json::Error> {
    let mut crds = Vec::new();
    for crd in crate::all_crds() {
        crds.push(serde_json::to_value(&crd)?);
    }
    let mut out = String::new();
    out.push_str("# API reference\n\n");
    out.push_str(
        "<!-- Generated from the CRD schemas by `cargo run -p ramify-crds --bin crdgen -- --docs \
         docs/api-reference.md`; do not edit. `make test` fails when it differs. -->\n\n",
    );
    out.push_str(
        "Every field of every kind of `ramify.dev/v1alpha1`, as the API server validates it \
         (generated from the CRDs in `crds/yaml/ramify.dev.yaml`, which are generated from \
         the Rust types in `crds/src`; `kubectl explain` shows the same descriptions). A \
         path ending in `[]` is an item of a list. Rules are CEL validations: the API \
         server refuses a manifest that breaks one with its message.\n\n",
    );
    for crd in &crds {
        let kind = str_at(crd, &["spec", "names", "kind"]);
        let _ = writeln!(out, "- [{kind}](#{})", kind.to_lowercase());
    }
    for crd in &crds {
        kind_section(&mut out, crd);
    }
    Ok(out)
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_str().unwrap_or("")
}

fn kind_section(out: &mut String, crd: &Value) {
    let names = &crd["spec"]["names"];
    let kind = str_at(names, &["kind"]);
    let group = str_at(crd, &["spec", "group"]);
    let scope = str_at(crd, &["spec", "scope"]);
    let short: Vec<String> = strings(&names["shortNames"])
        .into_iter()
        .map(|s| format!("`{s}`"))
        .collect();
    let _ = writeln!(out, "\n## {kind}\n");
    let versions = crd["spec"]["versions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for version in &versions {
        let v = str_at(version, &["name"]);
        let _ = writeln!(
            out,
            "`{group}/{v}`, {}, plural `{}`{}.\n",
            scope.to_lowercase(),
            str_at(names, &["plural"]),
            if short.is_empty() {
                String::new()
            } else {
                format!(", short name {}", short.join(", "))
            }
        );
        if let Some(cols) = version["additionalPrinterColumns"].as_array() {
            out.push_str("Columns of `kubectl get` (`-o wide` adds those of priority 1):\n\n");
            out.push_str("| column | from | priority |\n|---|---|---|\n");
            for c in cols {
                let _ = writeln!(
                    out,
                    "| {} | `{}` | {} |",
                    str_at(c, &["name"]),
                    cell(str_at(c, &["jsonPath"])),
                    c["priority"].as_i64().unwrap_or(0)
                );
            }
            out.push('\n');
        }
        let root = &version["schema"]["openAPIV3Schema"];
        for part in ["spec", "status"] {
            let schema = &root["properties"][part];
            if schema.is_null() {
                continue;
            }
            let _ = writeln!(out, "### {kind}.{part}\n");
            if let Some(d) = schema["description"].as_str() {
                let _ = writeln!(out, "{}\n", escape_html(d.trim()));
            }
            let mut rows = Vec::new();
            let required = required_of(root);
            if required.iter().any(|r| r == part) {
                out.push_str("Required.\n\n");
            }
            let intro = details(schema, false);
            if !intro.is_empty() {
                let _ = writeln!(out, "{}\n", intro.join(" "));
            }
            children(part, schema, &mut rows);
            if rows.is_empty() {
                out.push_str("No fields.\n\n");
                continue;
            }
            out.push_str("| field | type | description |\n|---|---|---|\n");
            for r in rows {
                out.push_str(&r);
            }
            out.push('\n');
        }
    }
}

/// The strings of a JSON list (none when it is not one).
fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn required_of(schema: &Value) -> Vec<String> {
    strings(&schema["required"])
        .into_iter()
        .map(str::to_string)
        .collect()
}

/// Rows for the fields below `schema` (an object's properties, a list's items, a map's
/// values), depth first.
fn children(path: &str, schema: &Value, rows: &mut Vec<String>) {
    if let Some(props) = schema["properties"].as_object() {
        let required = required_of(schema);
        for (name, child) in props {
            field(
                &format!("{path}.{name}"),
                name,
                child,
                required.contains(name),
                rows,
            );
        }
    }
    if let Some(items) = schema.get("items").filter(|i| i.is_object()) {
        children(&format!("{path}[]"), items, rows);
    }
    if let Some(values) = schema.get("additionalProperties").filter(|i| i.is_object()) {
        children(&format!("{path}.<key>"), values, rows);
    }
}

fn field(path: &str, name: &str, schema: &Value, required: bool, rows: &mut Vec<String>) {
    let mut text = escape_html(schema["description"].as_str().unwrap_or("").trim());
    let embedded = EMBEDDED.iter().find(|(n, _)| *n == name);
    if let Some((_, what)) = embedded {
        let _ = write!(text, " Its fields: {what}.");
    }
    let extra = details(schema, required);
    if !extra.is_empty() {
        if !text.is_empty() {
            text.push_str("<br>");
        }
        text.push_str(&extra.join(" "));
    }
    rows.push(format!(
        "| `{}` | {} | {} |\n",
        cell(path),
        cell(&type_of(schema)),
        cell_text(&text)
    ));
    if embedded.is_none() {
        children(path, schema, rows);
    }
}

fn type_of(schema: &Value) -> String {
    if schema["x-kubernetes-int-or-string"].as_bool() == Some(true) {
        return "int or string".into();
    }
    if schema["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true)
        && schema["properties"].is_null()
    {
        return "any".into();
    }
    let base = match schema["type"].as_str() {
        Some("array") => format!("[]{}", type_of(&schema["items"])),
        Some("object")
            if schema["properties"].is_null() && schema["additionalProperties"].is_object() =>
        {
            format!("map[string]{}", type_of(&schema["additionalProperties"]))
        }
        Some(t) => t.to_string(),
        None => "any".into(),
    };
    match schema["format"].as_str() {
        Some(f) => format!("{base} ({f})"),
        None => base,
    }
}

/// What the schema says of a field beyond its description.
fn details(schema: &Value, required: bool) -> Vec<String> {
    let mut d = Vec::new();
    if required {
        d.push("Required.".to_string());
    }
    if let Some(v) = schema.get("default") {
        d.push(format!("Default: `{}`.", compact(v)));
    }
    if let Some(e) = schema["enum"].as_array() {
        let vals: Vec<String> = e.iter().map(|v| format!("`{}`", compact(v))).collect();
        d.push(format!("One of: {}.", vals.join(", ")));
    }
    for (key, what) in [
        ("minimum", "Minimum"),
        ("maximum", "Maximum"),
        ("minLength", "Minimum length"),
        ("maxLength", "Maximum length"),
        ("minItems", "Minimum items"),
        ("maxItems", "Maximum items"),
        ("minProperties", "Minimum entries"),
        ("maxProperties", "Maximum entries"),
    ] {
        if let Some(v) = schema.get(key) {
            d.push(format!("{what}: {}.", compact(v)));
        }
    }
    if let Some(p) = schema["pattern"].as_str() {
        d.push(format!("Pattern: `{p}`."));
    }
    if let Some(t) = schema["x-kubernetes-list-type"].as_str() {
        let keys: Vec<String> = strings(&schema["x-kubernetes-list-map-keys"])
            .into_iter()
            .map(|k| format!("`{k}`"))
            .collect();
        if keys.is_empty() {
            d.push(format!("List type: {t}."));
        } else {
            d.push(format!("List type: {t}, keyed by {}.", keys.join(", ")));
        }
    }
    if schema["nullable"].as_bool() == Some(true) {
        d.push("May be null.".to_string());
    }
    if let Some(rules) = schema["x-kubernetes-validations"].as_array() {
        for r in rules {
            let rule = str_at(r, &["rule"]);
            match r["message"].as_str() {
                Some(m) => d.push(format!("Rule: {m} (`{rule}`).")),
                None => d.push(format!("Rule: `{rule}`.")),
            }
        }
    }
    d
}

fn compact(v: &Value) -> String {
    match v {
        Value::String(s) if !s.is_empty() => s.clone(),
        other => other.to_string(),
    }
}

/// `<` and `>` outside code spans as entities, so that `<name>` in prose is not read as
/// an HTML tag (inside code spans they stay as they are).
fn escape_html(s: &str) -> String {
    s.split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                part.to_string()
            } else {
                part.replace('<', "&lt;").replace('>', "&gt;")
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

/// A table cell: no line breaks, `|` escaped (also inside code spans, as GitHub reads them).
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// A description cell: paragraph breaks kept as `<br>`.
fn cell_text(s: &str) -> String {
    cell(&s.replace("\n\n", "<br>"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn types_read_as_in_kubectl_explain() {
        assert_eq!(
            type_of(&json!({"type": "array", "items": {"type": "string"}})),
            "[]string"
        );
        assert_eq!(
            type_of(&json!({"type": "object", "additionalProperties": {"type": "string"}})),
            "map[string]string"
        );
        assert_eq!(
            type_of(&json!({"type": "integer", "format": "int32"})),
            "integer (int32)"
        );
        assert_eq!(
            type_of(&json!({"x-kubernetes-int-or-string": true})),
            "int or string"
        );
    }

    #[test]
    fn prose_angle_brackets_are_not_tags() {
        assert_eq!(
            escape_html("named <sandbox>-self-<n>, as `a<b>`"),
            "named &lt;sandbox&gt;-self-&lt;n&gt;, as `a<b>`"
        );
    }

    #[test]
    fn every_kind_and_its_validations_are_listed() {
        let md = api_reference_markdown().unwrap_or_else(|e| panic!("render: {e}"));
        for kind in ["Sandbox", "Snapshot", "BranchSet", "RootfsClass"] {
            assert!(md.contains(&format!("\n## {kind}\n")), "{kind} missing");
        }
        assert!(md.contains("| `spec.source.sandbox` |"), "{md}");
        assert!(md.contains("Default: `FirstCommitWins`."));
        assert!(md.contains("Rule: "));
        // A `|` in a rule never splits a table row.
        for line in md.lines().filter(|l| l.starts_with("| `")) {
            let unescaped = line.replace("\\|", "");
            assert_eq!(unescaped.matches('|').count(), 4, "{line}");
        }
    }
}
