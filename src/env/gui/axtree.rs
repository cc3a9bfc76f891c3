//! The accessibility tree as the policy reads it: Chromium's `Accessibility.getFullAXTree` nodes
//! rendered as indented text lines, each shown node numbered `[n]`, with the map from those
//! numbers back to the DOM nodes (`backendDOMNodeId`) that actions target. Pure: no browser.
//!
//! Ignored nodes and unnamed structural wrappers (`generic`, `none`) are not shown (their children
//! are, one level up); inline text boxes never are, and a text run that only repeats its parent's
//! name is dropped. A line is `[n] role "name"` plus the states that matter for acting (value,
//! checked, pressed, selected, expanded, disabled, focused, required, readonly, invalid, level).

use std::collections::HashMap;

use serde_json::Value;

/// Roles that are shown only when they carry a name.
const WRAPPER_ROLES: [&str; 3] = ["generic", "none", "LineBreak"];

/// Properties shown on a line, in this order.
const SHOWN_PROPERTIES: [&str; 10] = [
    "checked", "pressed", "selected", "expanded", "disabled", "focused", "required", "readonly",
    "invalid", "level",
];

/// The longest name or value shown, in characters; longer ones end in `…`.
const MAX_TEXT_CHARS: usize = 200;

/// A rendered tree: the text and, for each `[n]`, its DOM node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RenderedTree {
    /// One line per shown node, indented two spaces per level.
    pub text: String,
    /// `backend[n - 1]` is the `backendDOMNodeId` of element `[n]`.
    pub backend: Vec<i64>,
    /// Whether nodes were left out because the tree exceeded the byte budget.
    pub truncated: bool,
}

impl RenderedTree {
    /// The DOM node of element `[id]`, if there is one.
    pub fn backend_node(&self, id: u64) -> Option<i64> {
        let i = usize::try_from(id).ok()?.checked_sub(1)?;
        self.backend.get(i).copied()
    }
}

/// Why the browser's tree could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the accessibility tree from the browser is malformed: {0}")]
pub struct TreeError(String);

struct Node<'a> {
    ignored: bool,
    role: &'a str,
    name: &'a str,
    value: Option<String>,
    backend: Option<i64>,
    children: Vec<&'a str>,
    properties: Vec<(&'a str, String)>,
}

fn text_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn parse_node(v: &Value) -> Result<(&str, Node<'_>), TreeError> {
    let id = v["nodeId"]
        .as_str()
        .ok_or_else(|| TreeError(format!("a node without a string `nodeId`: {v}")))?;
    let role = v["role"]["value"].as_str().unwrap_or("");
    let name = v["name"]["value"].as_str().unwrap_or("");
    let value = v.get("value").and_then(|x| text_of(&x["value"]));
    let children = match v.get("childIds") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|c| {
                c.as_str()
                    .ok_or_else(|| TreeError(format!("node {id}: a child id is not a string")))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(TreeError(format!("node {id}: `childIds` is not a list"))),
    };
    let mut properties = Vec::new();
    if let Some(Value::Array(props)) = v.get("properties") {
        for p in props {
            if let (Some(n), Some(val)) = (p["name"].as_str(), text_of(&p["value"]["value"])) {
                properties.push((n, val));
            }
        }
    }
    Ok((
        id,
        Node {
            ignored: v["ignored"].as_bool().unwrap_or(false),
            role,
            name,
            value,
            backend: v["backendDOMNodeId"].as_i64(),
            children,
            properties,
        },
    ))
}

fn clip(s: &str) -> String {
    let s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.chars().count() <= MAX_TEXT_CHARS {
        return s;
    }
    let mut t: String = s.chars().take(MAX_TEXT_CHARS).collect();
    t.push('…');
    t
}

fn quoted(s: &str) -> String {
    serde_json::to_string(&clip(s)).expect("strings serialise")
}

/// Renders `nodes` (the `nodes` list of `Accessibility.getFullAXTree`) in at most `max_bytes`
/// bytes of text (whole lines; the rest is left out and `truncated` set). The root is the first
/// node that is no other node's child.
pub fn render(nodes: &[Value], max_bytes: usize) -> Result<RenderedTree, TreeError> {
    let mut by_id: HashMap<&str, Node<'_>> = HashMap::with_capacity(nodes.len());
    let mut order = Vec::with_capacity(nodes.len());
    for v in nodes {
        let (id, node) = parse_node(v)?;
        if by_id.insert(id, node).is_some() {
            return Err(TreeError(format!("node id {id} appears twice")));
        }
        order.push(id);
    }
    let mut out = RenderedTree::default();
    let children: std::collections::HashSet<&str> = by_id
        .values()
        .flat_map(|n| n.children.iter().copied())
        .collect();
    let Some(root) = order.iter().copied().find(|id| !children.contains(id)) else {
        return Ok(out);
    };
    // Depth-first, children in order; (node id, depth, nearest shown ancestor's name).
    let mut stack: Vec<(&str, usize, &str)> = vec![(root, 0, "")];
    let mut visited = 0usize;
    while let Some((id, depth, parent_name)) = stack.pop() {
        let Some(node) = by_id.get(id) else {
            // Chromium lists children it does not return (e.g. inline text boxes); skip them.
            continue;
        };
        visited += 1;
        if visited > nodes.len() {
            return Err(TreeError("the child links form a cycle".into()));
        }
        let hidden = node.ignored
            || node.role == "InlineTextBox"
            || (WRAPPER_ROLES.contains(&node.role) && node.name.trim().is_empty())
            || (node.role == "StaticText"
                && (node.name.trim().is_empty() || clip(node.name) == clip(parent_name)));
        let (child_depth, child_parent) = if hidden {
            (depth, parent_name)
        } else if out.truncated {
            (depth + 1, node.name)
        } else {
            let mut line = "  ".repeat(depth);
            match node.backend {
                Some(b) => {
                    out.backend.push(b);
                    line.push_str(&format!("[{}] ", out.backend.len()));
                }
                None => line.push_str("[-] "),
            }
            line.push_str(if node.role.is_empty() {
                "unknown"
            } else {
                node.role
            });
            if !node.name.trim().is_empty() {
                line.push(' ');
                line.push_str(&quoted(node.name));
            }
            if let Some(v) = &node.value {
                line.push_str(&format!(" value={}", quoted(v)));
            }
            for key in SHOWN_PROPERTIES {
                if let Some((_, v)) = node.properties.iter().find(|(k, _)| *k == key) {
                    let default_off = matches!(
                        key,
                        "disabled" | "focused" | "required" | "readonly" | "invalid"
                    );
                    if default_off && (v == "false" || v.is_empty()) {
                        continue;
                    }
                    if default_off && v == "true" {
                        line.push_str(&format!(" {key}"));
                    } else {
                        line.push_str(&format!(" {key}={v}"));
                    }
                }
            }
            line.push('\n');
            if out.text.len() + line.len() > max_bytes {
                out.truncated = true;
                if node.backend.is_some() {
                    out.backend.pop();
                }
            } else {
                out.text.push_str(&line);
            }
            (depth + 1, node.name)
        };
        for c in node.children.iter().rev() {
            stack.push((c, child_depth, child_parent));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(id: &str, role: &str, name: &str, backend: i64, children: &[&str]) -> Value {
        json!({
            "nodeId": id, "ignored": false, "role": {"type": "role", "value": role},
            "name": {"type": "computedString", "value": name},
            "backendDOMNodeId": backend, "childIds": children,
        })
    }

    fn sample() -> Vec<Value> {
        let mut checkbox = node("6", "checkbox", "Subscribe", 60, &[]);
        checkbox["properties"] = json!([
            {"name": "focusable", "value": {"type": "booleanOrUndefined", "value": true}},
            {"name": "checked", "value": {"type": "tristate", "value": "false"}},
        ]);
        let mut textbox = node("5", "textbox", "Email", 50, &[]);
        textbox["value"] = json!({"type": "string", "value": "a@b.c"});
        textbox["properties"] = json!([
            {"name": "focused", "value": {"type": "booleanOrUndefined", "value": true}},
            {"name": "required", "value": {"type": "boolean", "value": false}},
        ]);
        let mut heading = node("3", "heading", "Sign up", 30, &["9"]);
        heading["properties"] =
            json!([{"name": "level", "value": {"type": "integer", "value": 1}}]);
        let mut ignored = node("2", "none", "", 20, &["3", "4"]);
        ignored["ignored"] = json!(true);
        vec![
            node("1", "RootWebArea", "Form", 10, &["2"]),
            ignored,
            heading,
            node("4", "generic", "", 40, &["5", "6", "7", "8"]),
            textbox,
            checkbox,
            node("7", "button", "Send", 70, &["10"]),
            node("8", "StaticText", "Fill in the form", 80, &["11"]),
            node("9", "StaticText", "Sign up", 90, &[]),
            node("10", "StaticText", "Send", 100, &[]),
            json!({"nodeId": "11", "ignored": false, "role": {"value": "InlineTextBox"},
                   "childIds": []}),
        ]
    }

    #[test]
    fn renders_roles_names_states_and_ids() {
        let t = render(&sample(), 10_000).unwrap();
        assert_eq!(
            t.text,
            concat!(
                "[1] RootWebArea \"Form\"\n",
                "  [2] heading \"Sign up\" level=1\n",
                "  [3] textbox \"Email\" value=\"a@b.c\" focused\n",
                "  [4] checkbox \"Subscribe\" checked=false\n",
                "  [5] button \"Send\"\n",
                "  [6] StaticText \"Fill in the form\"\n",
            )
        );
        assert_eq!(t.backend, vec![10, 30, 50, 60, 70, 80]);
        assert_eq!(t.backend_node(4), Some(60));
        assert_eq!(t.backend_node(0), None);
        assert_eq!(t.backend_node(7), None);
        assert!(!t.truncated);
    }

    #[test]
    fn byte_budget_truncates_whole_lines_and_says_so() {
        let full = render(&sample(), 10_000).unwrap();
        let three: usize = full.text.lines().take(3).map(|l| l.len() + 1).sum();
        let t = render(&sample(), three + 5).unwrap();
        assert_eq!(t.text.lines().count(), 3);
        assert_eq!(t.backend.len(), 3);
        assert!(t.truncated);
    }

    #[test]
    fn long_names_are_clipped_and_quoted() {
        let long = format!("a \"quote\"\n{}", "x".repeat(500));
        let t = render(&[node("1", "RootWebArea", &long, 1, &[])], 1000).unwrap();
        assert!(t.text.starts_with("[1] RootWebArea \"a \\\"quote\\\" xxx"));
        assert!(t.text.trim_end().ends_with("…\""), "{}", t.text);
        assert!(t.text.len() < 260);
    }

    #[test]
    fn malformed_trees_are_errors() {
        assert!(render(&[json!({"role": {"value": "x"}})], 1000).is_err());
        let twice = [node("1", "a", "", 1, &[]), node("1", "b", "", 2, &[])];
        assert!(render(&twice, 1000).is_err());
        let bad_children = [json!({"nodeId": "1", "childIds": "2"})];
        assert!(render(&bad_children, 1000).is_err());
        let cycle = [
            node("1", "RootWebArea", "R", 1, &["2"]),
            node("2", "group", "G", 2, &["3"]),
            node("3", "group", "H", 3, &["2"]),
        ];
        assert!(render(&cycle, 1000)
            .unwrap_err()
            .to_string()
            .contains("cycle"));
        // A child id without a node is skipped, not an error.
        let t = render(&[node("1", "RootWebArea", "R", 1, &["404"])], 1000).unwrap();
        assert_eq!(t.backend, vec![1]);
        assert_eq!(render(&[], 1000).unwrap(), RenderedTree::default());
    }
}
