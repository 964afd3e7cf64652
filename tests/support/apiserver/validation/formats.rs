//! The formats upstream checks names and values against (`k8s.io/apimachinery/pkg/util/validation`):
//! DNS labels and subdomains, C identifiers, qualified attribute names, label keys and values,
//! quantities and semantic versions, with the messages the real server sends.

use serde_json::json;

use super::Errors;

pub(super) const DNS_LABEL_MAX: usize = 63;
const DNS_SUBDOMAIN_MAX: usize = 253;
const ID_MAX: usize = 32;
const DOMAIN_MAX: usize = 63;

const DNS_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
pub(super) const DNS_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const C_IDENTIFIER_MSG: &str = "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')";
pub(super) const LABEL_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
pub(super) const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
pub(super) const QUANTITY_MSG: &str =
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'";
pub(super) const SEMVER_MSG: &str = "must be a string compatible with semver.org spec 2.0.0";

fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && bytes.first().is_some_and(alnum)
        && bytes.last().is_some_and(alnum)
        && bytes.iter().all(|b| alnum(b) || *b == b'-')
}

pub(super) fn is_dns_subdomain(s: &str) -> bool {
    s.split('.').all(is_dns_label)
}

pub(super) fn dns_label(errors: &mut Errors, field: &str, value: &str) {
    if value.len() > DNS_LABEL_MAX {
        errors.invalid(
            field,
            &json!(value),
            format!("must be no more than {DNS_LABEL_MAX} characters"),
        );
    }
    if !is_dns_label(value) {
        errors.invalid(field, &json!(value), DNS_LABEL_MSG);
    }
}

pub(super) fn dns_subdomain(errors: &mut Errors, field: &str, value: &str) {
    if value.len() > DNS_SUBDOMAIN_MAX {
        errors.invalid(
            field,
            &json!(value),
            format!("must be no more than {DNS_SUBDOMAIN_MAX} characters"),
        );
    }
    if !is_dns_subdomain(value) {
        errors.invalid(field, &json!(value), DNS_SUBDOMAIN_MSG);
    }
}

fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// An attribute or capacity name: a C identifier, optionally prefixed by a domain and `/`.
pub(super) fn qualified_name(errors: &mut Errors, field: &str, name: &str) {
    let c_identifier = |errors: &mut Errors, id: &str| {
        if id.len() > ID_MAX {
            errors.too_long(field, ID_MAX);
        }
        if !is_c_identifier(id) {
            errors.invalid(field, &json!(id), C_IDENTIFIER_MSG);
        }
    };
    let parts: Vec<&str> = name.split('/').collect();
    match parts.as_slice() {
        [""] => errors.required(field, "name required"),
        [id] => c_identifier(errors, id),
        [domain, id] => {
            if domain.is_empty() {
                errors.required(field, "the domain must not be empty");
            } else {
                if domain.len() > DOMAIN_MAX {
                    errors.too_long(field, DOMAIN_MAX);
                }
                if !is_dns_subdomain(domain) {
                    errors.invalid(field, &json!(domain), DNS_SUBDOMAIN_MSG);
                }
            }
            if id.is_empty() {
                errors.required(field, "the name must not be empty");
            } else {
                c_identifier(errors, id);
            }
        }
        _ => errors.invalid(
            field,
            &json!(name),
            "must be either a C identifier or a domain followed by a slash and a C identifier",
        ),
    }
}

/// A label-style key (taint keys): optional DNS-subdomain prefix and `/`, then a name of ≤ 63 characters.
pub(super) fn label_key(errors: &mut Errors, field: &str, key: &str) {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() || prefix.len() > DNS_SUBDOMAIN_MAX || !is_dns_subdomain(prefix) {
            errors.invalid(
                field,
                &json!(key),
                format!("prefix part {DNS_SUBDOMAIN_MSG}"),
            );
        }
    }
    if name.is_empty() {
        errors.invalid(field, &json!(key), "name part must be non-empty");
    } else if name.len() > DNS_LABEL_MAX {
        errors.invalid(
            field,
            &json!(key),
            "name part must be no more than 63 characters",
        );
    } else if !is_label_value(name) {
        errors.invalid(field, &json!(key), LABEL_NAME_MSG);
    }
}

/// A label value: empty, or ≤ 63 alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
pub(super) fn is_label_value(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    s.is_empty()
        || (s.len() <= DNS_LABEL_MAX
            && s.starts_with(alnum)
            && s.ends_with(alnum)
            && s.chars().all(|c| alnum(c) || "-_.".contains(c)))
}

/// A Kubernetes quantity: a signed decimal number and an optional binary, decimal-SI or exponent suffix.
pub(super) fn is_quantity(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let number_len = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(number_len);
    let digits = number.chars().filter(char::is_ascii_digit).count();
    if digits == 0 || number.matches('.').count() > 1 {
        return false;
    }
    const SUFFIXES: [&str; 16] = [
        "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
    ];
    if SUFFIXES.contains(&suffix) {
        return true;
    }
    let Some(exponent) = suffix.strip_prefix(['e', 'E']) else {
        return false;
    };
    let exponent = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
    !exponent.is_empty() && exponent.chars().all(|c| c.is_ascii_digit())
}

/// Strict semantic versioning 2.0.0: `MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]`, no leading zeros.
pub(super) fn is_semver(s: &str) -> bool {
    let numeric = |p: &str| {
        !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) && (p == "0" || !p.starts_with('0'))
    };
    let ident = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    let (rest, build) = match s.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let core: Vec<&str> = core.split('.').collect();
    let pre_ok = pre.is_none_or(|pre| {
        pre.split('.')
            .all(|p| ident(p) && (!p.chars().all(|c| c.is_ascii_digit()) || numeric(p)))
    });
    core.len() == 3
        && core.iter().all(|p| numeric(p))
        && pre_ok
        && build.is_none_or(|b| b.split('.').all(ident))
}

#[cfg(test)]
mod tests {
    use super::{is_quantity, is_semver};

    #[test]
    fn quantities() {
        for good in [
            "0", "1", "80Gi", "1.5", "-2", "+3k", "100m", "1e3", "2E-2", ".5", "7Ei",
        ] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in ["", "Gi", "1.2.3", "1GB", "1e", "abc", "1 Gi", "1Gi2"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn semvers() {
        for good in [
            "1.2.3",
            "0.0.0",
            "10.20.30",
            "1.0.0-alpha.1",
            "1.0.0-0.3.7",
            "1.0.0+build.5",
            "1.2.3-rc-1+x",
        ] {
            assert!(is_semver(good), "{good}");
        }
        for bad in [
            "1.2",
            "v1.2.3",
            "01.2.3",
            "1.2.3-",
            "1.2.3-01",
            "1.2.3+",
            "1.2.3.4",
            "1.2.3-a..b",
            "580.95.05",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }
}
