//! Checks of what the kubelet sends before any of it is used in an API path, a file name or a CDI name.

/// A Kubernetes UID as the API server generates it: a lowercase RFC 4122 UUID. Anything else is refused,
/// since the UID becomes part of CDI file and device names.
pub fn check_uid(uid: &str) -> Result<(), String> {
    let groups: Vec<&str> = uid.split('-').collect();
    let lengths = [8, 4, 4, 4, 12];
    let well_formed = groups.len() == lengths.len()
        && groups.iter().zip(lengths).all(|(group, len)| {
            group.len() == len
                && group
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
    if well_formed {
        Ok(())
    } else {
        Err(format!(
            "claim UID {:?} is not a lowercase UUID",
            truncated(uid)
        ))
    }
}

/// A namespace is a DNS label (RFC 1123): at most 63 lowercase alphanumerics or '-', alphanumeric at both ends.
pub fn check_namespace(namespace: &str) -> Result<(), String> {
    if is_dns_label(namespace) {
        Ok(())
    } else {
        Err(format!(
            "namespace {:?} is not a valid DNS label",
            truncated(namespace)
        ))
    }
}

/// A ResourceClaim name is a DNS subdomain: at most 253 characters of DNS labels joined by '.'.
pub fn check_claim_name(name: &str) -> Result<(), String> {
    if is_dns_subdomain(name, 253) {
        Ok(())
    } else {
        Err(format!(
            "claim name {:?} is not a valid DNS subdomain",
            truncated(name)
        ))
    }
}

/// RFC 1123 subdomain of at most `max_len` characters: DNS labels joined by '.'.
pub fn is_dns_subdomain(name: &str, max_len: usize) -> bool {
    name.len() <= max_len && name.split('.').all(is_dns_label)
}

/// RFC 1123 label: 1 to 63 lowercase alphanumerics or '-', alphanumeric at both ends.
pub fn is_dns_label(label: &str) -> bool {
    let bytes = label.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

/// Keeps error messages short when the input is huge.
pub fn truncated(text: &str) -> String {
    text.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids() {
        assert!(check_uid("0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b").is_ok());
        for bad in [
            "",
            "../../etc/passwd",
            "0B5E6A1C-2F3D-4E5F-8A9B-0C1D2E3F4A5B",
            "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b/..",
            "0b5e6a1c2f3d4e5f8a9b0c1d2e3f4a5b",
            "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5",
            "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5g",
        ] {
            assert!(check_uid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn namespaces_and_names() {
        assert!(check_namespace("kube-system").is_ok());
        assert!(check_claim_name("my-claim.v2").is_ok());
        for bad in ["", "-a", "a-", "A", "a/b", "..", &"a".repeat(64)] {
            assert!(check_namespace(bad).is_err(), "{bad}");
        }
        for bad in ["", "a..b", "a/b", "../x", "x.", &"a".repeat(254)] {
            assert!(check_claim_name(bad).is_err(), "{bad}");
        }
    }
}
