//! Cost models: how long a step plan takes on the GPU, and how long a request spends
//! outside it (HTTP, tokenisation, streaming). Two implementations behind one trait:
//!
//! * [`Analytic`]: a roofline from the catalog's hardware and model numbers plus a few
//!   calibration coefficients;
//! * [`Profiled`]: a model fitted to step times measured by `engine profile`.

mod analytic;
mod least_squares;
pub use least_squares::Line;
mod profiled;
mod spread;

pub use analytic::Analytic;
pub use profiled::{
    Profile, ProfileClient, ProfileCoverage, ProfilePoint, ProfileStructuredOutput, Profiled,
};
pub use spread::{AfterIdle, AfterPrefill, SincePrefill, SpreadBand, StepSpread};

pub use infer_core::StepShape;

/// A request's path outside the GPU, as a client sees it.
///
/// ```text
/// scheduler sees the request  = start + request_s + per_prompt_token_s × prompt tokens
/// client sees a token         = step end + stream_s
/// ```
/// so TTFT and E2E include both, while ITL (gaps between chunks) does not. `start` is the
/// send, or the end of the request sent to the same replica before it if that is later:
/// a server's request path takes one request at a time, in the order they were sent.
///
/// Where the path and the step share the CPU's cores (a CPU engine), a step that runs while
/// a request is in the path loses `overlap_step_loss` of its pace for as long as they
/// overlap ([`ClientPath::overlap_late`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClientPath {
    /// HTTP parse, routing, request validation.
    pub request_s: f64,
    /// Tokenisation, per prompt token.
    pub per_prompt_token_s: f64,
    /// Detokenise one token and deliver the chunk over the stream.
    pub stream_s: f64,
    /// The share of a step's pace lost while a request is in the server's path, from 0
    /// (they do not contend: a GPU step beside the host's tokeniser) to below 1.
    pub overlap_step_loss: f64,
}

impl ClientPath {
    pub fn request_delay(&self, prompt_tokens: usize) -> f64 {
        self.request_s + self.per_prompt_token_s * prompt_tokens as f64
    }

    /// How much longer a step of `step_s` takes when the request path is busy for
    /// `path_left_s` more as it starts: it runs at `1 − overlap_step_loss` of its pace
    /// while they overlap. The path keeps its own pace (its stretch is not priced). The
    /// loss is measured on short decode steps; on long prefill steps it is lost in their
    /// own noise, and priced alike.
    pub fn overlap_late(&self, step_s: f64, path_left_s: f64) -> f64 {
        let k = self.overlap_step_loss;
        if !(k > 0.0 && path_left_s > 0.0) {
            return 0.0;
        }
        if path_left_s * (1.0 - k) >= step_s {
            // Overlapped throughout.
            step_s * k / (1.0 - k)
        } else {
            k * path_left_s
        }
    }
}

/// Step time for a plan, and the client path around it.
pub trait CostModel: Send + Sync {
    /// Seconds the step takes on one replica.
    fn step_time(&self, shape: &StepShape) -> f64;
    /// Device memory the step's activations take, in bytes per GPU (0: not modelled).
    fn activation_bytes(&self, _shape: &StepShape) -> f64 {
        0.0
    }
    /// Extra seconds every step pays while `spilled_bytes` of device memory live on the
    /// host (moved out and back).
    fn spill_time(&self, _spilled_bytes: f64) -> f64 {
        0.0
    }
    /// Mean seconds of the random host pause each step pays on top of `step_time`
    /// (exponentially distributed; 0: none, and nothing is drawn).
    fn step_jitter(&self) -> f64 {
        0.0
    }
    /// How served steps spread around `step_time` (each simulated step is multiplied by a
    /// factor drawn from it, of mean 1); `None`: every step takes exactly `step_time`.
    fn step_spread(&self) -> Option<&StepSpread> {
        None
    }
    /// What the decode steps just after a step with prompt tokens cost on top of the rest;
    /// `None`: nothing.
    fn after_prefill(&self) -> Option<&AfterPrefill> {
        None
    }
    /// What the first step after an idle spell costs (its factor replaces the spread's
    /// draw for that step); `None`: nothing.
    fn after_idle(&self) -> Option<AfterIdle> {
        None
    }
    fn client_path(&self) -> ClientPath;
    /// Where the model prices a step as passes of consecutive slots: the tokens a pass
    /// holds at most and whether a pass's keys are padded to its longest context (the
    /// driver then sets [`StepShape::slot_passes`]). `None`: it does not.
    fn slot_passes(&self) -> Option<(usize, bool)> {
        None
    }
    /// Seconds a constrained sequence (structured output) adds to a step for its token,
    /// included in `step_time`; `None`: the model has no such cost (a scenario with
    /// structured output is then refused).
    fn constrained_token_s(&self) -> Option<f64> {
        None
    }
    /// Static batching only: how long an idle engine waits after a request arrives before
    /// starting the batch (to fill it).
    fn static_batch_window(&self) -> f64 {
        0.0
    }
    /// The model, every coefficient and where they come from, in full (run.json keeps it).
    fn describe(&self) -> String;
    /// The model, its key coefficients and where they come from, in a few lines short
    /// enough for a console (what `sim run` prints; `describe` has the rest). By default
    /// `describe`, for a model whose description is short.
    fn summary(&self) -> String {
        self.describe()
    }
}
