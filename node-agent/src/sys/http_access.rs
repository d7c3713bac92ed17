//! Who may read the HTTP endpoint (`telemetry.listen`): the source addresses allowed
//! (`telemetry.allow_from`, loopback only by default) and, when `telemetry.bearer_token_file` is
//! set, a bearer token (what Prometheus sends with `authorization: credentials_file`). Decided
//! before any data is looked at; the answer for a refused request names no job.

use std::net::IpAddr;

/// One allowed network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    /// `10.0.0.0/8`, `::1/128`, or a bare address (the whole address).
    pub fn parse(s: &str) -> Option<Net> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.trim().parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            Some(p) => p.trim().parse::<u8>().ok().filter(|p| *p <= max)?,
            None => max,
        };
        Some(Net { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4 peer of a dual-stack listener shows as ::ffff:a.b.c.d.
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// 403: the source address is not in `allow_from`.
    Source,
    /// 401: no or a wrong bearer token.
    Token,
}

#[derive(Debug, Clone, Default)]
pub struct Access {
    pub allow_from: Vec<Net>,
    /// The token requests must carry, when configured.
    pub token: Option<String>,
}

impl Access {
    pub fn check(&self, peer: Option<IpAddr>, authorization: Option<&str>) -> Result<(), Refused> {
        if !peer.is_some_and(|ip| self.allow_from.iter().any(|n| n.contains(ip))) {
            return Err(Refused::Source);
        }
        if let Some(want) = &self.token {
            let got = authorization.and_then(|h| h.trim().strip_prefix("Bearer "));
            if !got.is_some_and(|t| same(t.trim().as_bytes(), want.as_bytes())) {
                return Err(Refused::Token);
            }
        }
        Ok(())
    }
}

/// Compares without stopping at the first difference (the time taken says nothing of the token).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        s.parse().ok()
    }

    #[test]
    fn networks_match_by_prefix_and_v4_mapped_addresses_count_as_v4() {
        let n = Net::parse("10.1.0.0/16").unwrap();
        assert!(n.contains("10.1.200.3".parse().unwrap()));
        assert!(!n.contains("10.2.0.1".parse().unwrap()));
        assert!(n.contains("::ffff:10.1.0.9".parse().unwrap()));
        let lo6 = Net::parse("::1").unwrap();
        assert!(lo6.contains("::1".parse().unwrap()));
        assert!(!lo6.contains("127.0.0.1".parse().unwrap()));
        assert!(Net::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        for bad in ["10.0.0.0/33", "localhost", "10.0.0/8", "::1/129", ""] {
            assert!(Net::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_request_needs_an_allowed_source_and_the_token_when_one_is_set() {
        let lo = Access {
            allow_from: vec![Net::parse("127.0.0.1/32").unwrap()],
            token: None,
        };
        assert_eq!(lo.check(ip("127.0.0.1"), None), Ok(()));
        assert_eq!(lo.check(ip("192.168.1.5"), None), Err(Refused::Source));
        assert_eq!(lo.check(None, None), Err(Refused::Source));
        let tok = Access {
            token: Some("s3cret".into()),
            ..lo
        };
        assert_eq!(tok.check(ip("127.0.0.1"), None), Err(Refused::Token));
        assert_eq!(
            tok.check(ip("127.0.0.1"), Some("Bearer wrong")),
            Err(Refused::Token)
        );
        assert_eq!(
            tok.check(ip("127.0.0.1"), Some("Basic s3cret")),
            Err(Refused::Token)
        );
        assert_eq!(tok.check(ip("127.0.0.1"), Some("Bearer s3cret")), Ok(()));
        // The token does not open the door to a source outside the list.
        assert_eq!(
            tok.check(ip("192.168.1.5"), Some("Bearer s3cret")),
            Err(Refused::Source)
        );
    }
}
