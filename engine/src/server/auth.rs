//! `engine serve --api-key`, as vLLM's: every path under `/v1` needs the header
//! `Authorization: Bearer <key>` with one of the keys, or is answered 401; the rest — health,
//! metrics, tokenisation, the load and cache endpoints routers use — stays open, so probes
//! and routers need no key.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::api::ApiError;

/// The keys a request may present.
#[derive(Clone)]
pub struct ApiKeys(Arc<[String]>);

impl ApiKeys {
    /// `None` when there is no key: the server is open. An empty key is refused: it would
    /// let in anyone who sends `Bearer ` with nothing after it.
    pub fn new(keys: &[String]) -> anyhow::Result<Option<Self>> {
        anyhow::ensure!(
            keys.iter().all(|k| !k.is_empty()),
            "--api-key: a key cannot be empty"
        );
        Ok((!keys.is_empty()).then(|| ApiKeys(keys.into())))
    }

    fn accepts(&self, given: &str) -> bool {
        // Every key compared in full, whatever matches: the time taken says nothing of
        // how much of a key was right.
        self.0.iter().fold(false, |ok, k| {
            same_bytes(k.as_bytes(), given.as_bytes()) | ok
        })
    }
}

/// Equal, in a time that depends on the lengths only.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

pub async fn require_api_key(State(keys): State<ApiKeys>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let guarded = path == "/v1" || path.starts_with("/v1/");
    if !guarded || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(key) if keys.accepts(key) => next.run(req).await,
        _ => ApiError {
            status: StatusCode::UNAUTHORIZED,
            ..ApiError::bad_request(
                None,
                "missing or incorrect API key: send the header `Authorization: Bearer <key>`",
            )
        }
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_key_is_accepted() {
        let keys = ApiKeys::new(&["sk-one".into(), "sk-two".into()])
            .unwrap()
            .unwrap();
        assert!(keys.accepts("sk-one") && keys.accepts("sk-two"));
        for wrong in ["", "sk-on", "sk-one ", "sk-onE", "sk-three", "sk-onesk-two"] {
            assert!(!keys.accepts(wrong), "{wrong:?}");
        }
        assert!(ApiKeys::new(&[]).unwrap().is_none());
        assert!(ApiKeys::new(&["sk-one".into(), String::new()]).is_err());
    }
}
