//! Node network ports from sysfs: InfiniBand/RoCE ports (`/sys/class/infiniband/*/ports/*/counters`)
//! and network interfaces (`/sys/class/net/*/statistics`, loopback left out). A counter that is
//! absent or unreadable is `None`.

use crate::sample::NicSample;
use std::path::Path;

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn sum(dir: &Path, names: &[&str]) -> Option<u64> {
    let vals: Vec<u64> = names
        .iter()
        .filter_map(|n| read_u64(&dir.join(n)))
        .collect();
    (!vals.is_empty()).then(|| vals.iter().sum())
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    v.sort();
    v
}

/// Reads every port under `sys` (normally `/sys`).
pub fn read(sys: &Path) -> Vec<NicSample> {
    let mut out = Vec::new();
    let ib = sys.join("class/infiniband");
    for dev in entries(&ib) {
        for port in entries(&ib.join(&dev).join("ports")) {
            let c = ib.join(&dev).join("ports").join(&port).join("counters");
            // port_rcv_data / port_xmit_data count 4-byte words.
            out.push(NicSample {
                port: format!("{dev}/{port}"),
                rx_bytes: read_u64(&c.join("port_rcv_data")).map(|w| w.saturating_mul(4)),
                tx_bytes: read_u64(&c.join("port_xmit_data")).map(|w| w.saturating_mul(4)),
                errors: sum(
                    &c,
                    &[
                        "symbol_error",
                        "port_rcv_errors",
                        "link_downed",
                        "link_error_recovery",
                    ],
                ),
                // Congestion (a full transmit queue), not a broken link.
                discards: read_u64(&c.join("port_xmit_discards")),
            });
        }
    }
    let net = sys.join("class/net");
    for ifc in entries(&net) {
        if ifc == "lo" {
            continue;
        }
        let s = net.join(&ifc).join("statistics");
        out.push(NicSample {
            port: ifc,
            rx_bytes: read_u64(&s.join("rx_bytes")),
            tx_bytes: read_u64(&s.join("tx_bytes")),
            errors: sum(&s, &["rx_errors", "tx_errors"]),
            discards: read_u64(&s.join("tx_dropped")),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ib_and_net_counters_and_skips_what_is_missing() {
        let d = std::env::temp_dir().join(format!("mpsr-nic-{}", std::process::id()));
        let c = d.join("class/infiniband/mlx5_0/ports/1/counters");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(c.join("port_rcv_data"), "10\n").unwrap();
        std::fs::write(c.join("symbol_error"), "2\n").unwrap();
        std::fs::write(c.join("link_downed"), "1\n").unwrap();
        let s = d.join("class/net/eth0/statistics");
        std::fs::create_dir_all(&s).unwrap();
        std::fs::write(s.join("rx_bytes"), "5\n").unwrap();
        std::fs::create_dir_all(d.join("class/net/lo/statistics")).unwrap();
        let got = read(&d);
        std::fs::remove_dir_all(&d).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].port, "mlx5_0/1");
        assert_eq!(got[0].rx_bytes, Some(40));
        assert_eq!(got[0].tx_bytes, None);
        assert_eq!(got[0].errors, Some(3));
        assert_eq!(got[1].port, "eth0");
        assert_eq!(got[1].errors, None);
    }
}
