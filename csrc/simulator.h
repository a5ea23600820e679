// Discrete-event simulation of one mini-batch (one optimizer step) of a P x D
// pipeline, driven by the same StageScheduler decisions the runtime uses
// (varuna_sdk/pipeline/engine.py), so what is simulated is what runs.
//
// Pure C++17, no Python types (bound in bindings.cpp, Python face in
// varuna_sdk/planner/simulate.py).  Units everywhere: seconds, bytes, bytes/s.
//
// ---------------------------------------------------------------------------------
// Model
//
// Ranks.  rank = replica * P + stage, host = rank / ranks_per_host.  Each rank is a
// state machine running its stage's StageScheduler:
//   * when the rank becomes free at time t it calls
//       next(acts_arrived_by_t, grads_arrived_by_t)
//     (stage 0 passes acts = 0, the last stage grads = 0, exactly like the runtime);
//     a message arriving exactly at t counts as arrived;
//   * the returned action needs an input: F(i) on stage > 0 needs activation i,
//     B(i) on a non-last stage needs gradient i, R needs nothing; the action starts
//     at max(t, arrival of that input, a free compute slot on the host);
//   * duration = base * rank_compute_scale[rank] * jitter + action_overhead
//               (+ send_overhead when the action sends a message),
//     base = fwd[s] (F), rec[s] (R), bwd[s] (B), wgt[s] (W); jitter = max(0, 1 + N(0, rel_sigma));
//   * split_backward (Varuna only, the zero-bubble split): bwd[s] is then the input-gradient
//     part B alone and wgt[s] the weight-gradient part W, which the stage's scheduler defers into
//     its waits (StageScheduler); W needs no input and sends nothing;
//   * compute slots: with compute_slots_per_host = k > 0 at most k actions run at once
//     on a host (workers sharing cores or one GPU); a rank whose input is ready but
//     finds no slot waits (FIFO by request time, then rank) - recorded as WAIT.
//     0 = unlimited.  With time_share_slots the host's ready actions all run at once
//     instead, each progressing at min(1, k / running) (processor sharing, as an OS
//     time-slices cores among processes): no WAIT; an action's segment spans its
//     stretched wall time, stage_busy still counts its work.
// Messages.  After F(i) on a non-last stage the activation goes to stage s+1 of the
//   same replica; after B(i) on stage s > 0 the gradient goes to stage s-1.  Each
//   link direction carries one transfer at a time, FIFO:
//     start = max(end of the sending action, link free),
//     arrival = max(start + alpha + bytes / beta + |N(0, p2p_jitter_sigma)|,
//                   the arrival of the message sent before it on that channel),
//   with (local_alpha, local_beta) when both ranks are on one host, else
//   (p2p_alpha, p2p_beta).  The link is busy for alpha + bytes / beta; jitter delays a
//   message's delivery, not the link (the next transfer starts meanwhile), and delivery on a
//   channel stays in order.  With shared_egress a rank's two outgoing directions are one link.
// Event order.  Events are processed in time order; at equal times: action ends
//   (which send messages) before input-ready slot requests before decisions, then by
//   rank.  So a rank decides only after every message arriving at or before t is in.
// Synchronisation after the pipeline phase (as engine.py's _sync_and_step):
//   done[r]  = when rank r finished its last action and its last outgoing message
//              arrived (the runtime waits for its sends);
//   DP       : stage s's gradient all-reduce over its D replicas runs in buckets of
//              bucket_bytes launched during the stage's last gradient-producing action (the
//              last B, or with split_backward the last W; as pipeline/grad_sync.py): it ends at
//              max(done + allreduce_time(last bucket), last action's start +
//              allreduce_time(dp_bytes[s], D)) over the replicas; bucket_bytes = 0 (or one
//              bucket) = after done: done + allreduce_time(dp_bytes[s], D);
//   tied     : each tied group's all-reduce over all member ranks (its stages x all
//              replicas) starts when all of them are done (concurrently with the DP
//              all-reduce), lasts allreduce_time(bytes, |stages| * D);
//   consensus: one small world-wide all-reduce (overflow / grad norm) after every
//              rank's collectives: consensus_latency (0 when P*D == 1);
//   optimizer: stage s then steps for opt[s].
//   minibatch_time = max over ranks of the optimizer end.
//   allreduce_time(bytes, n) = 0 if n == 1 or bytes == 0, else
//              ar_alpha * 2(n-1) + 2(n-1)/n * bytes / ar_beta     (ring alpha-beta).
//   Concurrent collectives do not slow each other down (no network contention).
//
// Outputs (SimResult):
//   pipeline_time    = max over ranks of done[r] (start of the sync phase);
//   stage_busy[s]    = F+R+B compute time of stage s (incl. overheads and jitter; slot
//                      waits excluded), mean over replicas;
//   stage_bubble[s]  = 1 - stage_busy[s] / pipeline_time;
//   bubble_fraction  = mean of stage_bubble over stages.  For GPipe with uniform
//                      costs, free communication and no overheads this is exactly
//                      (P-1)/(m+P-1).
//   Memory: per micro-batch a stage holds either its stashed input only (forward
//   done without autograd, waiting for recompute) or a live graph (input + full
//   activations: after F without recompute or on the last stage, or after R) until
//   its B ends (with split_backward: its W ends).  A state is counted from the start of the
//   action that creates it.
//   peak_stashed[s], peak_live[s], peak_inflight[s] (= stashed + live) are maxima
//   over time and replicas, so memory(s) <= peak_stashed * input_bytes
//   + peak_live * (input + activation bytes) (the planner's business).
//
// Engines (SimConfig::engine; results are bit-identical, tests compare them):
//   * event loop: a priority queue of action ends, slot requests and decisions;
//     needed for compute slots and jitter.
//   * fast: heap-free conservative simulation used automatically without jitter and
//     slot contention (the planner's case): a rank decides as soon as the message
//     counts it would see at its decision time are certain (see simulator.cpp).
//     Falls back to the event loop when it cannot make progress (zero lookahead).
//
// Shortcuts:
//   * one replica: without jitter, without per-rank compute scales, and when hosts
//     never mix replicas (D == 1 or P % ranks_per_host == 0, so every replica sees the
//     same link locality and slot sharing) all replicas are identical: only replica 0
//     is simulated.  Results are bit-identical to the full simulation.
//   * extrapolate (opt-in; ignored with jitter or timeline): the mini-batch time is
//     eventually periodic in m: T(m + c) = T(m) + c * lambda once the pipeline has a
//     steady state that repeats every c micro-batches.  Procedure:
//       1. simulate mA ~ cap micro-batches, cap = extrapolate_cap or
//          (k + 1) * P + 32 with k = 4 for Varuna (its stage 0 runs ~4P forwards
//          ahead) and k = 1 otherwise; mA = m (mod 12);
//       2. detect the steady state in that run: on every stage the start times of
//          F(i) (past the warm-up) and of B(i) (past the fill, before the drain) must
//          advance by the same amount from i to i + c (rel. 1e-9) over stretches of
//          >= max(3c, 24) micro-batches; c = lcm of the per-sequence periods (<= 64);
//       3. one steady state (every sequence advances by the same d, F and B stretches
//          overlap in time, policy 1F1B or Varuna):
//            T(m) = T(m1) + (m - m1) * d / c            m1 = m (mod c), m1 >= mA
//          (m1 = mA when c divides 12: a single run);
//          otherwise (GPipe: all forwards, then all backwards; Varuna whose stage 0
//          ran far ahead; stages still drifting):
//            T(m) = T(m1) + (m - m1) (T(m1 + c) - T(m1)) / c
//          and outside GPipe the slope must be confirmed by a third run of about twice
//          the length (rel. 1e-9), else m is simulated exactly;
//       4. no steady state found: retry once with 2 * cap if that stays cheap, else
//          simulate m exactly.  Extrapolation is only attempted when the runs stay
//          well below m (<= 0.8 m).
//     Exact to rounding whenever the detected state is truly periodic (tests and
//     random sweeps: <= 1e-13 typically, worst seen 3e-4 relative).  Nearly balanced
//     stages lock onto the bottleneck slowly and Varuna with a latency shifts its
//     pattern for long, so such runs are often simulated exactly.  stage_busy is
//     scaled exactly (every micro-batch costs the same without jitter); stage_done /
//     pipeline_time shift like T; peaks grow with the in-flight count's growth over
//     the steady stretch (0 for a bounded state, 1 per micro-batch for GPipe).

#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "schedule.h"

namespace varuna {

struct TiedGroup {
    std::vector<int> stages;  // distinct stages in [0, P)
    double bytes = 0.0;       // gradient bytes summed over those stages and all replicas
};

struct SimConfig;
// The per-stage recompute flags a configuration runs with (stage_recompute, else `recompute`
// for every stage).
StageFlags stage_flags(const SimConfig& c);

struct SimConfig {
    int P = 1;  // pipeline stages
    int D = 1;  // data-parallel replicas
    int m = 1;  // micro-batches per mini-batch (per replica)
    Policy policy = Policy::Varuna;
    bool recompute = true;
    // Per-stage recompute (size P; overrides `recompute` when not empty) and per-stage in-flight
    // caps (size P, 0 = none; empty = no caps; Varuna only): see schedule.h.
    std::vector<bool> stage_recompute;
    std::vector<int> max_in_flight;
    bool split_backward = false;  // B (input gradient) and W (weight gradients) apart

    // Per stage, seconds per micro-batch.  fwd, bwd: size P.  rec: size P or empty
    // (= fwd).  opt: optimizer step seconds, size P or empty (= 0).  wgt: the W part
    // (split_backward only, then size P; bwd is then the B part alone).
    std::vector<double> fwd, bwd, rec, opt, wgt;
    // Bytes per micro-batch across boundary s -> s+1: size P-1 or P (last entry
    // ignored) or empty (= 0).  grad_bytes (s+1 -> s): same, empty = act_bytes.
    std::vector<double> act_bytes, grad_bytes;
    // Gradient bytes all-reduced across the D replicas of each stage: size P or empty.
    std::vector<double> dp_bytes;
    std::vector<TiedGroup> tied;

    // Network (seconds, bytes/s).  beta = +inf means free bandwidth.
    double p2p_alpha = 0.0;
    double p2p_beta = std::numeric_limits<double>::infinity();
    double local_alpha = 0.0;
    double local_beta = std::numeric_limits<double>::infinity();
    double ar_alpha = 0.0;
    double ar_beta = std::numeric_limits<double>::infinity();
    double consensus_latency = 0.0;
    // true: each rank's outgoing messages share one link (one NIC, as a VM has; a namespace host's
    // veth): activations downstream and gradients upstream go one at a time, FIFO; false: each
    // direction has its own link.
    bool shared_egress = false;
    // Reading the mini-batch's data, seconds per rank (each rank of a replica reads the replica's
    // examples: stage 0 its inputs, the last stage its targets; 0 = not modelled).  With
    // data_prefetch the next mini-batch is read while this one computes (data.prefetch,
    // data/prefetch.py): a mini-batch lasts max(pipeline + sync, read); without, the read comes
    // first: pipeline + sync + read.  Applied once to the whole mini-batch (with_data_read()).
    double data_read = 0.0;
    bool data_prefetch = true;
    // Gradient all-reduce bucket (bytes): buckets start during the last backward (see above);
    // 0 = one all-reduce after the pipeline phase.
    double bucket_bytes = 4194304.0;

    // Placement.
    int ranks_per_host = 1;          // >= 1
    int compute_slots_per_host = 0;  // 0 = unlimited
    // How ranks share a host's slots: false = queue (an action waits for a free slot, then
    // runs at full speed); true = time-sharing, as an OS shares cores among processes: every
    // ready action runs at once, each at min(1, slots / running actions) of full speed.
    bool time_share_slots = false;

    // Fixed costs (seconds).
    double action_overhead = 0.0;  // added to every F/R/B/W
    double send_overhead = 0.0;    // added to an action that sends a message

    // Noise, reproducible for a given seed.
    double p2p_jitter_sigma = 0.0;    // seconds; half-normal extra delay per transfer
    double compute_jitter_rel = 0.0;  // relative sigma of each action's base time
    std::uint64_t seed = 0;

    // Optional per-rank compute slowdown (stragglers): size P*D or empty (= 1).
    std::vector<double> rank_compute_scale;

    bool record_timeline = false;  // per-rank segments + transfers (costs memory)
    bool extrapolate = false;      // see header comment
    int extrapolate_cap = 0;       // first run length; 0 = 5P + 32 (Varuna) or 2P + 32
    bool replica_shortcut = true;  // allow the one-replica shortcut when exact
    // 0 auto (fast engine when applicable, else event loop), 1 event loop,
    // 2 fast (std::invalid_argument when not applicable).  See simulator.cpp.
    int engine = 0;
};

enum class SegmentKind : int {
    Forward = 0,
    Recompute = 1,
    Backward = 2,
    Wait = 3,      // input ready, waiting for a compute slot
    AllReduce = 4, // data-parallel gradient all-reduce of the stage
    Tied = 5,      // tied-weight gradient all-reduce (one per group)
    Consensus = 6, // world-wide consensus all-reduce
    Optimizer = 7,
    Weight = 8,    // W: weight gradients of a split backward
};

struct Segment {
    SegmentKind kind;
    int mb;  // micro-batch, or tied-group index for Tied, else -1
    double start, end;
};

struct Transfer {
    int kind;  // 0 = activation (s -> s+1), 1 = gradient (s -> s-1)
    int mb;
    int src, dst;  // ranks
    double start, end;
};

struct SimResult {
    double minibatch_time = 0.0;
    double pipeline_time = 0.0;
    double bubble_fraction = 0.0;
    std::vector<double> stage_busy, stage_bubble;
    std::vector<double> stage_done;  // max over replicas of done[r]
    std::vector<int> peak_stashed, peak_live, peak_inflight;

    int replicas_simulated = 0;  // 1 (shortcut) or D
    bool extrapolated = false;
    int m_simulated[2] = {0, 0};  // (m, 0) exact; extrapolated (m1, m2), m2 = 0 for one run
    long long events = 0;          // compute actions simulated (all runs)
    int engine_used = 0;           // 1 event loop, 2 fast (of the last run)
    int period = 0;                // extrapolation: detected steady-state period c, 0 none
    double data_wait = 0.0;        // of minibatch_time, seconds waiting for data (SimConfig::data_read)

    // Only with record_timeline: index = simulated rank (replica * P + stage).
    std::vector<std::vector<Segment>> timeline;
    std::vector<Transfer> transfers;
};

// Ring all-reduce alpha-beta time; 0 when n <= 1 or bytes <= 0.
double allreduce_time(double bytes, int n, double ar_alpha, double ar_beta);

// When a stage's bucketed gradient all-reduce of `bytes` over D replicas ends, its pipeline
// phase done at `done` and its last gradient-producing action started at `grad_start` (see
// the DP rule above; cfg gives ar_alpha, ar_beta, bucket_bytes).
double dp_allreduce_end(double bytes, int D, double done, double grad_start, const SimConfig& cfg);

// A mini-batch's time with its data read (SimConfig::data_read): max(t, read) when the read is
// prefetched during the previous mini-batch, else t + read.  Monotone in t (lower bounds stay so).
double with_data_read(double t, double read, bool prefetch);

// Throws std::invalid_argument with a message naming the offending field.
void validate(const SimConfig& cfg);

// Validates, then simulates.  Throws std::invalid_argument on bad input.
SimResult simulate(const SimConfig& cfg);

}  // namespace varuna
