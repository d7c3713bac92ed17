//! HTTP for telemetry (`telemetry.listen`, off by default): `GET /metrics` (Prometheus text) and
//! `GET /v1/jobs/<id>` (a job's ranks here, JSON, for `mpsrctl job-skew` on another node). Read
//! only. Both show job ids, uids and pids of MPS clients: only the sources in
//! `telemetry.allow_from` (loopback by default) get an answer, and with
//! `telemetry.bearer_token_file` only requests carrying the token (`http_access`).

use crate::agent::Agent;
use crate::sys::http_access::{Access, Refused};
use crate::sys::lock;
use std::sync::Arc;
use tiny_http::{Header, Method, Response, Server};

pub fn serve(agent: Arc<Agent>, server: Server, access: Access) {
    for req in server.incoming_requests() {
        let auth = req
            .headers()
            .iter()
            .find(|h| h.field.equiv("Authorization"))
            .map(|h| h.value.as_str().to_string());
        let peer = req.remote_addr().map(|a| a.ip());
        let (status, ctype, body) = match access.check(peer, auth.as_deref()) {
            Ok(()) => route(&agent, req.method(), req.url()),
            Err(Refused::Source) => (
                403,
                "text/plain",
                "not an allowed source (telemetry.allow_from)\n".into(),
            ),
            Err(Refused::Token) => (
                401,
                "text/plain",
                "a bearer token is needed (telemetry.bearer_token_file)\n".into(),
            ),
        };
        let header = Header::from_bytes("Content-Type", ctype).ok();
        let mut resp = Response::from_string(body).with_status_code(status);
        if let Some(h) = header {
            resp = resp.with_header(h);
        }
        if let Err(e) = req.respond(resp) {
            tracing::debug!(error = %e, "telemetry HTTP reply not sent");
        }
    }
}

fn route(agent: &Agent, method: &Method, url: &str) -> (u16, &'static str, String) {
    const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
    const JSON: &str = "application/json";
    if *method != Method::Get {
        return (405, TEXT, "only GET\n".into());
    }
    let path = url.split('?').next().unwrap_or("");
    if path == "/metrics" {
        let gpus: Vec<u32> = agent.backend.gpus().iter().map(|g| g.index).collect();
        let own = super::fault_metrics::render(
            &agent.store.lock(),
            &gpus,
            &agent.node,
            agent.backend.simulated(),
        );
        let telemetry = mpsr_telemetry::metrics::render(&agent.exporter);
        // Both texts end with `# EOF` (OpenMetrics): one, at the end.
        let strip = |t: &str| t.strip_suffix("# EOF\n").unwrap_or(t).to_string();
        let body = format!("{}{}# EOF\n", strip(&telemetry), strip(&own));
        return (200, TEXT, body);
    }
    if let Some(id) = path.strip_prefix("/v1/jobs/") {
        let Ok(job) = id.parse::<u32>() else {
            return (400, TEXT, format!("'{id}' is not a job id\n"));
        };
        let snap = lock(&agent.exporter.0).clone();
        let view = mpsr_telemetry::skew::job_view(&snap, job);
        return match serde_json::to_string(&view) {
            Ok(s) => (200, JSON, s),
            Err(e) => (500, TEXT, format!("{e}\n")),
        };
    }
    (404, TEXT, "GET /metrics or /v1/jobs/<id>\n".into())
}
