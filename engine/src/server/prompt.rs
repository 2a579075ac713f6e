//! Request bodies and prompts, read off the HTTP threads: a large body is parsed, and every
//! prompt tokenised, on the blocking pool at lower priority, and a prompt too long by its
//! bytes alone is refused before it is tokenised, so no request stalls the others.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::Value;

use super::api::{self, ApiError, Prompt};
use super::{AppState, Shared};
use crate::runtime::tokenizer::{TemplateOptions, TextTokenizer};

/// Bodies larger than this are parsed on the blocking pool (a 4 MiB JSON body takes an
/// HTTP thread ~10 ms), without waiting for a tokenizer permit: a prompt too long by its
/// bytes is still refused at once.
const PARSE_OFF_THREAD_BYTES: usize = 256 << 10;

pub(super) async fn body_or_error(
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    match body {
        Ok(b) if b.len() > PARSE_OFF_THREAD_BYTES => tokio::task::spawn_blocking(move || {
            yield_cpu_to_serving();
            api::parse_body(&b)
        })
        .await
        .map_err(|e| ApiError::internal(format!("body parsing failed: {e}")))?,
        Ok(b) => api::parse_body(&b),
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::too_large(format!(
            "request body too large: {}",
            r.body_text()
        ))),
        Err(r) => Err(ApiError::bad_request(None, r.body_text())),
    }
}

/// The longest prompt, in bytes, that could still fit `max_model_len` tokens: every token
/// stands for at most `max_token_bytes` bytes, with a factor 2 of slack for normalizers
/// that shorten text (Unicode composition) before it is split.
pub(super) fn prompt_bytes_limit(tokenizer: &TextTokenizer, max_model_len: usize) -> usize {
    tokenizer
        .max_token_bytes()
        .saturating_mul(max_model_len)
        .saturating_mul(2)
}

/// Jobs of at most this many bytes wait in the small lane of the tokenizer pool: one takes
/// ~15 ms to tokenise here, a 4 MiB one about a second.
pub(super) const SMALL_JOB_BYTES: usize = 64 << 10;

/// The large lane's input in flight at once, in KiB: two bodies of the 4 MiB limit. A
/// tokenised prompt holds ~270 bytes of memory per byte of text while it is encoded (the
/// tokenizer keeps each token's string, offsets and masks): one 4 MiB `/tokenize` peaks at
/// 1.2 GB, and half of 16 cores' worth at once would take 9 GB. The budget holds the lane
/// near 2.5 GB, whatever the core count.
pub(super) const LARGE_LANE_KIB: u32 = 8 << 10;

/// Runs tokenizer work (templating, encoding, decoding) of `bytes` bytes on the blocking
/// pool, so a large prompt never holds an HTTP thread: `/health` and every stream keep being
/// served while it is tokenised. Two lanes, each at most one job per two cores at a time:
/// small jobs never queue behind large ones (four 4 MiB `/tokenize` calls held a 12-byte
/// prompt's first token for seconds), and large ones queue behind each other.
pub(super) async fn off_thread<T: Send + 'static>(
    state: &AppState,
    bytes: usize,
    job: impl FnOnce(&Shared) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let shared = state.inner.clone();
    let closed = |_| ApiError::internal("the tokenizer pool is closed");
    let large = bytes > SMALL_JOB_BYTES;
    // A large job first waits for its bytes, then for a thread.
    let kib = if large {
        let kib =
            u32::try_from(bytes.div_ceil(1024)).map_or(LARGE_LANE_KIB, |k| k.min(LARGE_LANE_KIB));
        let budget = shared.tokenizer_large_kib.clone();
        Some(budget.acquire_many_owned(kib).await.map_err(closed)?)
    } else {
        None
    };
    let lane = if large {
        &shared.tokenizer_large
    } else {
        &shared.tokenizer_small
    };
    let permit = lane.clone().acquire_owned().await.map_err(closed)?;
    tokio::task::spawn_blocking(move || {
        yield_cpu_to_serving();
        let out = job(&shared);
        if large {
            give_memory_back();
        }
        drop((permit, kib));
        out
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer job failed: {e}")))
}

/// Lowers the calling blocking-pool thread's scheduling priority (nice +10, once per
/// thread; Linux nice values are per thread): seconds of tokenizing a huge prompt then
/// take only the CPU that the HTTP threads and the engine loop leave, so on a machine with
/// few cores `/health` and every stream keep their latency.
fn yield_cpu_to_serving() {
    thread_local!(static LOWERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    LOWERED.with(|lowered| {
        if !lowered.replace(true) {
            #[cfg(target_os = "linux")]
            // SAFETY: setpriority has no memory effects; `who = 0` is this thread.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            }
        }
    });
}

/// Returns the heap's free pages to the system after a large job: glibc keeps the hundreds
/// of megabytes a 4 MiB prompt's encoding took, and the server's resident memory would only
/// ever grow.
fn give_memory_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Refuses, by its length alone, a prompt that cannot fit `max_model_len` tokens: a huge
/// prompt is answered at once, without waiting for (or occupying) the tokenizer pool.
pub(super) fn check_prompt_bytes(s: &Shared, prompt: &Prompt) -> Result<(), ApiError> {
    let bytes = match prompt {
        Prompt::Tokens(_) => 0, // counted by their ids, before
        _ => prompt.bytes(),
    };
    if bytes > s.max_prompt_bytes {
        return Err(ApiError::bad_request(
            Some(if matches!(prompt, Prompt::Chat(_)) {
                "messages"
            } else {
                "prompt"
            }),
            format!(
                "this model's maximum context length is {} tokens, but the prompt has {bytes} \
                 bytes, more than {} tokens can hold",
                s.max_model_len, s.max_model_len
            ),
        ));
    }
    Ok(())
}

/// A prompt's tokens; a chat is rendered with `template`.
pub(super) fn prompt_tokens(
    s: &Shared,
    prompt: &Prompt,
    template: &TemplateOptions,
) -> Result<Vec<u32>, ApiError> {
    let tokens = match prompt {
        Prompt::Text(t) => s.tokenizer.encode(t, true),
        Prompt::Tokens(t) => {
            if let Some(bad) = t.iter().find(|&&x| x as usize >= s.vocab_size) {
                return Err(ApiError::bad_request(
                    Some("prompt"),
                    format!(
                        "token id {bad} is outside the vocabulary of {}",
                        s.vocab_size
                    ),
                ));
            }
            Ok(t.clone())
        }
        Prompt::Chat(messages) => {
            let text = s
                .tokenizer
                .apply_chat_template(messages, template)
                .map_err(|e| ApiError::bad_request(Some("messages"), format!("{e:#}")))?;
            s.tokenizer.encode(&text, false)
        }
    };
    let tokens = tokens.map_err(|e| ApiError::internal(format!("{e:#}")))?;
    if tokens.is_empty() {
        return Err(ApiError::bad_request(Some("prompt"), "the prompt is empty"));
    }
    Ok(tokens)
}
