//! Suggestions for `selectors check`: a selector that looks up an attribute, a capacity or a domain that
//! no checked device publishes gets a hint naming the nearest published one ("did you mean
//! productName?"), since a typo there is a CEL runtime error that blocks scheduling.

use std::collections::{BTreeMap, BTreeSet};

use super::SliceDevice;
use crate::cel::{DeviceMap, DeviceReference};

/// The attribute and capacity names the checked devices publish, per map and domain.
#[derive(Debug, Default)]
pub(crate) struct PublishedNames {
    names: BTreeMap<DeviceMap, BTreeMap<String, BTreeSet<String>>>,
}

impl PublishedNames {
    pub(crate) fn of(devices: &[SliceDevice]) -> PublishedNames {
        let mut published = PublishedNames::default();
        for device in devices {
            for (map, names) in [
                (DeviceMap::Attributes, &device.attributes),
                (DeviceMap::Capacity, &device.capacity),
            ] {
                for (domain, id) in names {
                    published
                        .names
                        .entry(map)
                        .or_default()
                        .entry(domain.clone())
                        .or_default()
                        .insert(id.clone());
                }
            }
        }
        published
    }

    fn domains(&self, map: DeviceMap) -> impl Iterator<Item = (&String, &BTreeSet<String>)> {
        self.names.get(&map).into_iter().flatten()
    }

    fn ids(&self, map: DeviceMap, domain: &str) -> Option<&BTreeSet<String>> {
        self.names.get(&map)?.get(domain)
    }

    /// One line per reference to a domain or a name that no device publishes, with the nearest published
    /// one where there is one. A name in an unknown domain gets only the domain's line.
    pub(crate) fn hints(&self, references: &[DeviceReference]) -> Vec<String> {
        references
            .iter()
            .filter_map(|reference| self.hint(reference))
            .collect()
    }

    fn hint(&self, reference: &DeviceReference) -> Option<String> {
        let DeviceReference { map, domain, name } = reference;
        let (plural, singular) = match map {
            DeviceMap::Attributes => ("attributes", "attribute"),
            DeviceMap::Capacity => ("capacities", "capacity"),
        };
        let Some(ids) = self.ids(*map, domain) else {
            // Only the domain's line: an unknown domain is an empty map, whatever is looked up in it.
            if name.is_some() {
                return None;
            }
            let known: Vec<&str> = self.domains(*map).map(|(d, _)| d.as_str()).collect();
            let line = format!("no device has {plural} in domain {domain}");
            return Some(with_suggestion(line, &nearest(domain, &known)));
        };
        let name = name.as_deref()?;
        if ids.contains(name) {
            return None;
        }
        let line = format!("no device has {singular} {domain}/{name}");
        let known: Vec<&str> = ids.iter().map(String::as_str).collect();
        let near = nearest(name, &known);
        if !near.is_empty() {
            return Some(with_suggestion(line, &near));
        }
        // The exact name elsewhere: another domain, or the other map.
        let elsewhere: Vec<String> = [DeviceMap::Attributes, DeviceMap::Capacity]
            .into_iter()
            .flat_map(|m| self.domains(m).map(move |(d, ids)| (m, d, ids)))
            .filter(|(m, d, ids)| (m, d.as_str()) != (map, domain.as_str()) && ids.contains(name))
            .map(|(m, d, _)| {
                let field = match m {
                    DeviceMap::Attributes => "attributes",
                    DeviceMap::Capacity => "capacity",
                };
                format!("device.{field}[\"{d}\"].{name}")
            })
            .take(SUGGESTIONS)
            .collect();
        let elsewhere: Vec<&str> = elsewhere.iter().map(String::as_str).collect();
        Some(with_suggestion(line, &elsewhere))
    }
}

/// At most this many names in one suggestion.
const SUGGESTIONS: usize = 3;

fn with_suggestion(line: String, suggestions: &[&str]) -> String {
    if suggestions.is_empty() {
        line
    } else {
        format!("{line}: did you mean {}?", suggestions.join(" or "))
    }
}

/// The candidates nearest to `name` (ignoring case), if near enough to be a typo of it: an edit distance
/// of at most a third of the name's length, between 1 and 3. Ties are all returned, up to
/// [`SUGGESTIONS`], in the candidates' order.
fn nearest<'a>(name: &str, candidates: &[&'a str]) -> Vec<&'a str> {
    let limit = (name.chars().count() / 3).clamp(1, 3);
    let lower = name.to_lowercase();
    let scored: Vec<(usize, &str)> = candidates
        .iter()
        .map(|c| (edit_distance(&lower, &c.to_lowercase()), *c))
        .filter(|(d, _)| *d <= limit)
        .collect();
    let Some(best) = scored.iter().map(|(d, _)| *d).min() else {
        return Vec::new();
    };
    scored
        .into_iter()
        .filter(|(d, _)| *d == best)
        .map(|(_, c)| c)
        .take(SUGGESTIONS)
        .collect()
}

/// Damerau-Levenshtein distance (optimal string alignment): insertions, deletions, substitutions and
/// swaps of two neighbouring characters each cost 1.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j]: the distance between the first i characters of a and the first j of b.
    let mut d: Vec<Vec<usize>> = (0..=a.len())
        .map(|i| {
            let mut row = vec![0; b.len() + 1];
            row[0] = i;
            row
        })
        .collect();
    d[0] = (0..=b.len()).collect();
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}
