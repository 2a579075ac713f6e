//! infer-sim: the discrete-event simulator. It drives the very same `infer-core` scheduler as
//! the engine, with a cost model standing in for the GPU. Filled by the sim issue.
