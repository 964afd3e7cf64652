//! Which ResourceSlices and devices a node can use: `nodeName`, `allNodes` and node selectors as the
//! scheduler's `NodeMatches` (component-helpers `nodeaffinity`) evaluates them against the node's name
//! and labels.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

/// The node allocation happens for: its name and labels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

impl Node {
    /// A node known by name only (node selectors see no labels).
    pub fn named(name: &str) -> Node {
        Node {
            name: name.to_string(),
            labels: BTreeMap::new(),
        }
    }

    /// `NodeMatches`: a name wins over `allNodes`, which wins over a selector; none of them means no.
    pub fn matches(
        &self,
        node_name: Option<&str>,
        all_nodes: Option<bool>,
        selector: Option<&NodeSelector>,
    ) -> Result<bool, String> {
        match (node_name.filter(|n| !n.is_empty()), all_nodes, selector) {
            (Some(name), _, _) => Ok(name == self.name),
            (None, Some(true), _) => Ok(true),
            (None, _, Some(selector)) => self.selected_by(selector),
            _ => Ok(false),
        }
    }

    /// The terms of a node selector are ORed; an empty term matches nothing.
    fn selected_by(&self, selector: &NodeSelector) -> Result<bool, String> {
        let mut any = false;
        for term in &selector.node_selector_terms {
            // Every term is checked so that an invalid one is reported even after a match.
            any |= self.term_matches(term)?;
        }
        Ok(any)
    }

    fn term_matches(&self, term: &NodeSelectorTerm) -> Result<bool, String> {
        let expressions = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if expressions.is_empty() && fields.is_empty() {
            return Ok(false);
        }
        let mut all = true;
        for requirement in expressions {
            all &= label_matches(&self.labels, requirement)?;
        }
        for requirement in fields {
            if requirement.key != "metadata.name" {
                return Err(format!(
                    "matchFields key {:?} is not supported (only metadata.name)",
                    requirement.key
                ));
            }
            let fields = BTreeMap::from([("metadata.name".to_string(), self.name.clone())]);
            if !matches!(requirement.operator.as_str(), "In" | "NotIn") {
                return Err(format!(
                    "matchFields operator {:?} is not supported (In, NotIn)",
                    requirement.operator
                ));
            }
            all &= label_matches(&fields, requirement)?;
        }
        Ok(all)
    }
}

/// One requirement of `matchExpressions` (a label selector requirement with Gt/Lt).
fn label_matches(
    labels: &BTreeMap<String, String>,
    requirement: &NodeSelectorRequirement,
) -> Result<bool, String> {
    let key = &requirement.key;
    let values = requirement.values.as_deref().unwrap_or_default();
    let value = labels.get(key);
    let invalid = |why: &str| Err(format!("requirement {key} {}: {why}", requirement.operator));
    match requirement.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => invalid("needs at least one value"),
        "In" => Ok(value.is_some_and(|v| values.contains(v))),
        "NotIn" => Ok(value.is_none_or(|v| !values.contains(v))),
        "Exists" | "DoesNotExist" if !values.is_empty() => invalid("takes no values"),
        "Exists" => Ok(value.is_some()),
        "DoesNotExist" => Ok(value.is_none()),
        "Gt" | "Lt" => {
            let [bound] = values else {
                return invalid("needs exactly one value");
            };
            let Ok(bound) = bound.parse::<i64>() else {
                return invalid("the value is not an integer");
            };
            // A label that is absent or not an integer does not match.
            let Some(actual) = value.and_then(|v| v.parse::<i64>().ok()) else {
                return Ok(false);
            };
            Ok(if requirement.operator == "Gt" {
                actual > bound
            } else {
                actual < bound
            })
        }
        _ => invalid("unknown operator"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn selector(value: serde_json::Value) -> NodeSelector {
        serde_json::from_value(json!({ "nodeSelectorTerms": value })).expect("node selector")
    }

    fn node() -> Node {
        Node {
            name: "node-a".into(),
            labels: BTreeMap::from([
                ("zone".to_string(), "z1".to_string()),
                ("gpus".to_string(), "8".to_string()),
            ]),
        }
    }

    fn matches(terms: serde_json::Value) -> Result<bool, String> {
        node().matches(None, None, Some(&selector(terms)))
    }

    #[test]
    fn name_all_nodes_and_nothing() {
        let node = node();
        assert_eq!(node.matches(Some("node-a"), None, None), Ok(true));
        assert_eq!(node.matches(Some("node-b"), Some(true), None), Ok(false));
        assert_eq!(node.matches(None, Some(true), None), Ok(true));
        assert_eq!(node.matches(None, None, None), Ok(false));
    }

    #[test]
    fn label_operators() {
        let expr = |key: &str, op: &str, values: &[&str]| {
            matches(json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}]))
        };
        assert_eq!(expr("zone", "In", &["z1", "z2"]), Ok(true));
        assert_eq!(expr("zone", "In", &["z2"]), Ok(false));
        assert_eq!(expr("zone", "NotIn", &["z2"]), Ok(true));
        assert_eq!(expr("rack", "NotIn", &["r1"]), Ok(true));
        assert_eq!(expr("zone", "Exists", &[]), Ok(true));
        assert_eq!(expr("rack", "Exists", &[]), Ok(false));
        assert_eq!(expr("rack", "DoesNotExist", &[]), Ok(true));
        assert_eq!(expr("gpus", "Gt", &["4"]), Ok(true));
        assert_eq!(expr("gpus", "Lt", &["4"]), Ok(false));
        assert_eq!(expr("zone", "Gt", &["4"]), Ok(false));
        assert!(expr("gpus", "Gt", &["four"]).is_err());
        assert!(expr("zone", "In", &[]).is_err());
        assert!(expr("zone", "Near", &["z1"]).is_err());
    }

    #[test]
    fn terms_are_ored_and_requirements_anded() {
        let z1 = json!({"key": "zone", "operator": "In", "values": ["z1"]});
        let z2 = json!({"key": "zone", "operator": "In", "values": ["z2"]});
        assert_eq!(matches(json!([{"matchExpressions": [z1, z2]}])), Ok(false));
        assert_eq!(
            matches(json!([{"matchExpressions": [z2]}, {"matchExpressions": [z1]}])),
            Ok(true)
        );
        assert_eq!(
            matches(json!([{}])),
            Ok(false),
            "an empty term matches nothing"
        );
    }

    #[test]
    fn match_fields_name() {
        let field = |op: &str, name: &str| {
            matches(
                json!([{"matchFields": [{"key": "metadata.name", "operator": op, "values": [name]}]}]),
            )
        };
        assert_eq!(field("In", "node-a"), Ok(true));
        assert_eq!(field("In", "node-b"), Ok(false));
        assert_eq!(field("NotIn", "node-b"), Ok(true));
        assert!(matches(
            json!([{"matchFields": [{"key": "metadata.uid", "operator": "In", "values": ["x"]}]}])
        )
        .is_err());
    }
}
