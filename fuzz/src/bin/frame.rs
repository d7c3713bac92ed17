//! Protocol frames and requests, as the agent and the keeper read them off their sockets. A
//! request that parses must come back unchanged through its own encoding.
use mpsr_proto::{keeper::KeeperRequest, read_frame, Request};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(r) = read_frame::<Request>(&mut &data[..]) {
            let again: Request = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
            assert_eq!(again, r);
        }
        let _ = read_frame::<KeeperRequest>(&mut &data[..]);
        // The body alone, as most inputs would never get a valid length prefix.
        if let Ok(r) = serde_json::from_slice::<Request>(data) {
            let again: Request = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
            assert_eq!(again, r);
        }
    });
}
