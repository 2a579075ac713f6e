//! `engine serve --api-key`, as vLLM's: every path under `/v1` needs the header
//! `Authorization: Bearer <key>` with one of the keys, or is answered 401 before its body is
//! read; the rest — health, metrics, tokenisation, the load, info and cache endpoints routers
//! call, and SGLang's `/v1/loads` among them — stays open, so routers and probes need no key.
//! One path outside `/v1` is guarded too: `POST /reset_prefix_cache`, the only one that
//! changes the server's state (vLLM serves it in development mode only, unguarded; here it
//! is always served, so with keys set a stranger must not be able to empty the cache).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;

use super::api::ApiError;

/// The keys a request may present.
#[derive(Clone)]
pub struct ApiKeys(Arc<[String]>);

impl ApiKeys {
    /// `None` when there is no key: the server is open. A key must be visible ASCII: an
    /// empty one would let in anyone who sends `Bearer ` with nothing after it, and one with
    /// spaces or other characters could never arrive intact in a header.
    pub fn new(keys: &[String]) -> anyhow::Result<Option<Self>> {
        for k in keys {
            anyhow::ensure!(
                !k.is_empty() && k.bytes().all(|b| b.is_ascii_graphic()),
                "--api-key: a key must be one or more visible ASCII characters, without spaces"
            );
        }
        Ok((!keys.is_empty()).then(|| ApiKeys(keys.into())))
    }

    fn accepts(&self, given: &str) -> bool {
        // Every key compared in full, whatever matches: the time taken says nothing of how
        // much of a key was right, nor of its length.
        self.0.iter().fold(false, |ok, k| {
            same_bytes(k.as_bytes(), given.as_bytes()) | ok
        })
    }
}

/// Equal, in a time that depends on the key's length only.
fn same_bytes(key: &[u8], given: &[u8]) -> bool {
    let mut diff = u8::from(key.len() != given.len());
    for (i, k) in key.iter().enumerate() {
        diff |= k ^ given.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// `app` behind the keys, if any: the outermost layer, so that a request without a key is
/// refused before anything reads its body.
pub fn guard(app: Router, keys: Option<&ApiKeys>) -> Router {
    match keys {
        Some(keys) => app.layer(axum::middleware::from_fn_with_state(
            keys.clone(),
            require_api_key,
        )),
        None => app,
    }
}

async fn require_api_key(State(keys): State<ApiKeys>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let guarded = ((path == "/v1" || path.starts_with("/v1/")) && path != "/v1/loads")
        || path == "/reset_prefix_cache";
    if !guarded || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    // The scheme is case-insensitive (RFC 7235; vLLM lower-cases it too).
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key);
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
        for wrong in [
            "",
            "sk-on",
            "sk-one ",
            "sk-onE",
            "sk-three",
            "sk-onesk-two",
            "sk-on\0",
        ] {
            assert!(!keys.accepts(wrong), "{wrong:?}");
        }
        assert!(ApiKeys::new(&[]).unwrap().is_none());
        for bad in ["", " sk", "sk one", "clé"] {
            assert!(
                ApiKeys::new(&["sk-one".into(), bad.into()]).is_err(),
                "{bad:?}"
            );
        }
    }
}
