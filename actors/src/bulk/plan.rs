//! Relay planning for broadcasts: who sends to whom, and how a relay's report is checked.
//! A node that must deliver a blob to a list of peers splits the list into at most `fanout`
//! contiguous groups; it sends to the head of each group and asks that head to deliver to the
//! rest of its group the same way. `fanout = 1` is a chain (every node sends one copy), larger
//! fan-outs give a shallower tree (each node sends `fanout` copies).

use std::collections::HashSet;

/// Outcome of delivering to a group of peers: (delivered, failed with reason).
pub(crate) type Outcome = (Vec<String>, Vec<(String, String)>);

/// Drops duplicates, empty names and `local` from `targets`, keeping first-seen order.
pub(crate) fn normalize(targets: &[String], local: &str) -> Vec<String> {
    let mut seen = HashSet::new();
    targets
        .iter()
        .filter(|t| !t.is_empty() && t.as_str() != local && seen.insert(t.as_str()))
        .cloned()
        .collect()
}

/// Splits `targets` into at most `fanout` groups of near-equal size; each group is returned as
/// (head, rest): the node sends to `head`, which relays to `rest`.
pub(crate) fn split(targets: &[String], fanout: usize) -> Vec<(String, Vec<String>)> {
    let fanout = fanout.max(1);
    let groups = fanout.min(targets.len());
    let mut out = Vec::with_capacity(groups);
    let mut start = 0;
    for g in 0..groups {
        let size = targets.len() / groups + usize::from(g < targets.len() % groups);
        let group = &targets[start..start + size];
        out.push((group[0].clone(), group[1..].to_vec()));
        start += size;
    }
    out
}

/// Checks a relay's report for the group `head` + `rest`: every name it mentions must belong to
/// the group and appear once; names it leaves out are counted as failed. Returns
/// (delivered, failed) or the reason the report is unacceptable.
pub(crate) fn reconcile(
    head: &str,
    rest: &[String],
    delivered: Vec<String>,
    failed: Vec<(String, String)>,
) -> Result<Outcome, String> {
    let group: HashSet<&str> = std::iter::once(head)
        .chain(rest.iter().map(String::as_str))
        .collect();
    let mut mentioned = HashSet::new();
    for name in delivered.iter().chain(failed.iter().map(|(n, _)| n)) {
        if !group.contains(name.as_str()) {
            return Err(format!("report names {name:?}, which is not in its group"));
        }
        if !mentioned.insert(name.clone()) {
            return Err(format!("report names {name:?} twice"));
        }
    }
    let mut failed = failed;
    for name in std::iter::once(head).chain(rest.iter().map(String::as_str)) {
        if !mentioned.contains(name) {
            failed.push((name.to_owned(), format!("missing from {head}'s report")));
        }
    }
    Ok((delivered, failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("n{i}")).collect()
    }

    #[test]
    fn fanout_one_is_a_chain() {
        let t = names(3);
        assert_eq!(
            split(&t, 1),
            vec![("n0".to_string(), vec!["n1".to_string(), "n2".to_string()])]
        );
    }

    #[test]
    fn wide_fanout_is_a_star_and_groups_are_balanced() {
        let t = names(3);
        let star = split(&t, 8);
        assert_eq!(star.len(), 3);
        assert!(star.iter().all(|(_, rest)| rest.is_empty()));
        let tree = split(&names(7), 2);
        assert_eq!(tree[0].0, "n0");
        assert_eq!(tree[0].1.len(), 3);
        assert_eq!(tree[1].0, "n4");
        assert_eq!(tree[1].1.len(), 2);
        assert!(split(&[], 2).is_empty());
    }

    #[test]
    fn normalize_drops_self_and_duplicates() {
        let t: Vec<String> = ["a", "me", "b", "a", ""].map(String::from).to_vec();
        assert_eq!(normalize(&t, "me"), vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn reconcile_fills_gaps_and_rejects_strangers() {
        let rest = vec!["c".to_string(), "d".to_string()];
        let (ok, failed) = reconcile(
            "b",
            &rest,
            vec!["b".into()],
            vec![("c".into(), "corrupt chunk".into())],
        )
        .unwrap();
        assert_eq!(ok, vec!["b".to_string()]);
        assert_eq!(failed.len(), 2);
        assert_eq!(failed[1].0, "d");
        assert!(reconcile("b", &rest, vec!["z".into()], vec![]).is_err());
        assert!(reconcile("b", &rest, vec!["b".into(), "b".into()], vec![]).is_err());
    }
}
