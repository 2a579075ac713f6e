//! Workload generation shared by the simulator and the load generator: scenario files,
//! length distributions, shared-prefix structures, arrival processes and prompts cut
//! deterministically from a fixed English corpus.

pub mod arrival;
pub mod corpus;
pub mod dist;
pub mod generate;
pub mod scenario;
pub mod trace;

pub use arrival::{ArrivalKind, ArrivalSpec, ArrivalTimes, Arrivals, Stage};
pub use corpus::{ApproxTokenizer, Token, Tokenizer};
pub use dist::{InvalidDist, LengthDist};
pub use generate::{GeneratedRequest, WorkloadGenerator};
pub use scenario::resolve_path;
pub use scenario::{
    ClusterSpec, ConversationsSpec, GroupsSpec, KvCacheDtype, RequestOrder, Scenario,
    ScenarioError, ServerSpec, WorkloadSpec,
};
pub use trace::{Chat, ChatTurn, Trace, TraceError, TraceFormat, TraceRow, TraceSpec};
