// Configuration search: the planner's inner loop (paper §4.1, §4.4).
//
// For G GPUs and a fixed global batch B, try every pipeline depth P in 1..min(G, n)
// (not only divisors of the segment count n), every replica count D <= G/P that divides B
// (or only the user's D, SearchInput::fixed_replicas), and every candidate micro-batch size
// b that divides B/D (so that B = b * m * D exactly).  For each (P, D, b): split the n
// segments into P contiguous stages minimising the slowest stage (binary search on the
// bottleneck + greedy packing, memory-aware), check memory, and simulate one mini-batch
// with the same StageScheduler the runtime uses.  One row per P: the fastest feasible
// (D, b) for that P per evaluate() (ties: fewer GPUs, then the larger micro-batch), with
// idle_gpus = G - P*D.  Every row that cannot run carries its reason.
//
// Pruning (exact): every (P, D, b) first gets split_free_bound() (valid for any split, no
// split needed), and, when that cannot rule it out, its split and time_lower_bound(): the
// bottleneck stage's busy time m * (F+R+B) with the pipeline fill before and the drain after
// it, each link's m transfers, a host's work over its compute slots, and the synchronisation
// that follows (see search.cpp), a bound no evaluate() result undercuts.  Best first: the
// candidate with the smallest bound is split or simulated next, and the depth ends when no
// bound can beat the best time found, so the row equals a brute-force enumeration of
// evaluate() (tests/test_planner.py checks both on random profiles).
//
// Cost.  Per depth P: O(#D x #sizes) split-free bounds, a few splits (binary search on the
// bottleneck, O(P log n) per packing; shared between m where memory allows), and usually one
// simulation (rarely a few) of min(m, max(P + 8, 64)) micro-batches on P stages, i.e.
// O(P * max(P + 8, 64)) actions.  So the exhaustive search is NOT linear in G: below the
// segment count n it grows ~quadratically in G (each depth simulates 64 micro-batches up to
// P ~ 56) and then ~cubically (P + 8 micro-batches per depth) up to G = n; beyond n the depths
// stop growing and only the replica counts (about log G of them for a power-of-two B), bounded
// but rarely simulated, grow.  The best-only search (SearchInput::exhaustive false) takes the
// options of ALL depths best first and stops when no bound can beat the fastest candidate
// found: every depth costs its split-free bounds (O(#D x #sizes), no split), and only the few
// options whose bound is below the best are split or simulated, so it grows about linearly in
// G.  Measured by benchmarks/bench_plan_speed.py (96 segments, 2-core testbed: exhaustive
// ~1.8 ms at G=8, ~75 ms at G=128, ~90 ms at G=1024; best only ~1.0 / 2.5 / 6.0 ms, G^0.32
// from G=8 to 128, the same best row at every G).
//
// Pure C++17, no Python types.  Units: seconds, bytes, bytes/s.
#pragma once

#include <string>
#include <vector>

#include "simulator.h"

namespace varuna {

// Per-segment costs at one micro-batch size (index k = segment).
struct SegmentTable {
    int micro_batch_size = 1;
    std::vector<double> fwd, rec, bwd;       // seconds per micro-batch
    // The split backward (zero-bubble): bwd_in = the input-gradient part B, wgt = the weight-
    // gradient part W, per segment; empty when not measured (SearchInput::split_backward then
    // refused).  The first stage has no input gradient: there B = 0 and W = its whole bwd.
    std::vector<double> bwd_in, wgt;
    std::vector<double> out_bytes;           // bytes crossing the cut-point after segment k
    std::vector<double> act_bytes;           // bytes saved for backward by segment k
};

struct SearchInput {
    int gpus = 1;
    int global_batch = 1;
    Policy policy = Policy::Varuna;
    bool recompute = true;
    // Per-stage overrides for evaluate(), candidate_lower_bound() and simulate_candidate() of one
    // depth P (search() refuses them: it searches with `recompute` everywhere): recompute per
    // stage (size P, empty = `recompute`) and in-flight caps per stage (size P, 0 = none, empty =
    // none; Varuna only), as SimConfig takes them.
    StageFlags stage_recompute;
    std::vector<int> max_in_flight;
    bool split_backward = false;             // Varuna only: B and W apart (tables need bwd_in, wgt)
    std::vector<SegmentTable> tables;        // one per candidate micro-batch size
    std::vector<double> param_bytes;         // per segment (first use)
    // Tied parameters: bytes and the segments that use them.
    std::vector<std::vector<int>> tied_segments;
    std::vector<double> tied_bytes;
    double optimizer_state_factor = 2.0;     // Adam: 2 x params
    double memory_limit = 0.0;               // bytes per GPU; 0 = unlimited
    int max_depth = 0;                       // 0 = no limit beyond min(G, n)
    // Replica count fixed by the user (must divide global_batch, <= gpus); 0 = choose per P.
    int fixed_replicas = 0;
    // Explicit stage boundaries (start segment of each stage, size P); empty = balance.
    std::vector<int> fixed_starts;
    // Segments where no stage may start (a tensor skips the cut-point before them: the model's
    // partition.unsplittable_cuts + 1); the balanced split starts each stage at the next allowed one.
    std::vector<int> forbidden_starts;
    SimConfig sim;                           // network, placement, overheads (P/D/m/costs filled in)
    double opt_s_per_param_byte = 0.0;
    // Sharing of a host's cores in the synchronisation phase (used only with
    // sim.compute_slots_per_host > 0): the share of a core each all-reduce participant keeps
    // busy, and how many ranks' end-of-step work (memory-bound) a host runs at full speed at
    // once (0 = as many as it has compute slots).
    double ar_cpu_share = 1.0;
    double opt_parallelism = 0.0;
    // Slowdown of compute per other busy core of the host (shared memory bandwidth, caches);
    // applied to each rank by the expected number of its host's other cores busy meanwhile.
    double compute_interference = 0.0;
    // Longest mini-batch simulated event by event; longer ones add the steady-state rate
    // for the remaining micro-batches (0 = max(P + 8, 64)).
    int sim_cap = 0;
    // true: every depth's row is its fastest candidate, simulated.  false (best only): search
    // best first across all depths and stop once no lower bound can beat the fastest candidate
    // found; a depth's row is then its fastest simulated candidate (not necessarily its depth's
    // fastest), or, if none was simulated, an infeasible row with Candidate::simulated false
    // and its smallest lower bound as minibatch_time.  The fastest row is the same either way.
    bool exhaustive = true;
    // Seconds to read one example of the data (0 = not modelled): every rank of a replica reads
    // the replica's global_batch / D examples per mini-batch (SimConfig::data_read), overlapped
    // with the previous mini-batch when data_prefetch.
    double data_read_per_example = 0.0;
    bool data_prefetch = true;
};

struct Candidate {
    int P = 0, D = 0, micro_batch_size = 0, m = 0, idle_gpus = 0;
    std::vector<int> starts;                 // first segment of each stage
    double minibatch_time = 0.0;             // seconds (simulated)
    double bubble_fraction = 0.0;
    double data_wait = 0.0;                  // of minibatch_time, seconds waiting for data
    std::vector<double> stage_memory;        // bytes, per stage (peak)
    // Simulated peak micro-batches per stage: inputs stashed for a recompute, live graphs.
    std::vector<int> peak_stashed, peak_live;
    std::vector<double> stage_compute;       // seconds per micro-batch (F+R+B), per stage
    bool feasible = false;
    // false: a best-only search's row whose candidates could not beat the fastest found and
    // were not simulated (infeasible, reason "pruned: ..."); minibatch_time is then a lower bound
    bool simulated = true;
    std::string reason;                      // why not feasible (empty if feasible)
};

// Memory of stage s holding segments [a, b) (bytes): weights + grads + optimizer state,
// plus stashed inputs / live activations as counted by the simulator.
double stage_memory(const SearchInput& in, const SegmentTable& t, int a, int b, int stashed, int live);

// Balanced contiguous split into P stages; returns start indices or empty when no
// split fits memory.  stash_bound(s) is the assumed number of in-flight micro-batches.
std::vector<int> balance(const SearchInput& in, const SegmentTable& t, int P, int m);

// Evaluate one (P, D, b) fully (split, simulate, memory).
Candidate evaluate(const SearchInput& in, int P, int D, int table_index);

// A lower bound (seconds) on evaluate(in, P, D, table_index).minibatch_time, computed without
// simulating (same split, same costs; +infinity when no split fits memory), or with split_free
// the cruder one search() uses before splitting, valid for every split into P stages. With
// any_recompute the bound holds for every per-stage recompute setting and in-flight caps (what a
// refinement of the candidate may choose): each stage's forward costs the cheaper of its two
// forwards, no recompute action, the busy time of a stage that keeps its activations.
double candidate_lower_bound(const SearchInput& in, int P, int D, int table_index, bool split_free = false,
                             bool any_recompute = false);

// What one search() did (counts over all depths).
struct SearchStats {
    long long depths = 0;         // rows (pipeline depths P)
    long long candidates = 0;     // (P, D, b) with B = b * m * D exactly
    long long bounded = 0;        // split and full lower bound computed
    long long splits = 0;         // balance() runs (splits are shared where memory allows)
    long long split_failed = 0;   // excluded before simulation: no split fits memory
    long long simulated = 0;      // evaluate()d: simulated event by event
    long long pruned = 0;         // skipped: lower bound >= the best time found for that P
    long long actions = 0;        // compute actions simulated (all simulations)
    long long pruned_rows = 0;     // pruned rows (best-only search: no candidate of the depth simulated)
};

// One candidate's mini-batch simulated event by event for its full m (no steady-state
// shortcut), with the same costs evaluate() uses, optionally recording the timeline and with
// extra per-rank compute slowdowns (stragglers; size P*D, empty = none).  For Gantt charts and
// what-if questions ("is the job faster without this slow worker?").
SimResult simulate_candidate(const SearchInput& in, int P, int D, int table_index, const std::vector<int>& starts,
                             const std::vector<double>& rank_scale, bool record_timeline);

// All depths, ranked: feasible first by minibatch_time, then infeasible ones.  stats, when
// given, receives what the search did.
std::vector<Candidate> search(const SearchInput& in, SearchStats* stats = nullptr);

}  // namespace varuna
