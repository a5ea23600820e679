// Configuration search: the planner's inner loop (paper §4.1, §4.4).
//
// For G GPUs and a fixed global batch B, try every pipeline depth P in 1..min(G, n)
// (not only divisors of the segment count n), the largest replica count D <= G/P that
// divides B, and every candidate micro-batch size b that divides B/D (so that
// B = b * m * D exactly).  For each (P, D, b): split the n segments into P contiguous
// stages minimising the slowest stage (binary search on the bottleneck + greedy
// packing, memory-aware), check memory, simulate one mini-batch with the same
// StageScheduler the runtime uses, and keep the fastest b per P.  Every candidate that
// cannot run carries its reason.  Cost grows about linearly in G: O(min(G, n)) depths,
// each with a bounded number of micro-batch sizes and an extrapolated simulation.
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
    std::vector<double> out_bytes;           // bytes crossing the cut-point after segment k
    std::vector<double> act_bytes;           // bytes saved for backward by segment k
};

struct SearchInput {
    int gpus = 1;
    int global_batch = 1;
    Policy policy = Policy::Varuna;
    bool recompute = true;
    std::vector<SegmentTable> tables;        // one per candidate micro-batch size
    std::vector<double> param_bytes;         // per segment (first use)
    // Tied parameters: bytes and the segments that use them.
    std::vector<std::vector<int>> tied_segments;
    std::vector<double> tied_bytes;
    double optimizer_state_factor = 2.0;     // Adam: 2 x params
    double memory_limit = 0.0;               // bytes per GPU; 0 = unlimited
    int max_depth = 0;                       // 0 = no limit beyond min(G, n)
    // Explicit stage boundaries (start segment of each stage, size P); empty = balance.
    std::vector<int> fixed_starts;
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
};

struct Candidate {
    int P = 0, D = 0, micro_batch_size = 0, m = 0, idle_gpus = 0;
    std::vector<int> starts;                 // first segment of each stage
    double minibatch_time = 0.0;             // seconds (simulated)
    double bubble_fraction = 0.0;
    std::vector<double> stage_memory;        // bytes, per stage (peak)
    std::vector<double> stage_compute;       // seconds per micro-batch (F+R+B), per stage
    bool feasible = false;
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

// One candidate's mini-batch simulated event by event for its full m (no steady-state
// shortcut), with the same costs evaluate() uses, optionally recording the timeline and with
// extra per-rank compute slowdowns (stragglers; size P*D, empty = none).  For Gantt charts and
// what-if questions ("is the job faster without this slow worker?").
SimResult simulate_candidate(const SearchInput& in, int P, int D, int table_index, const std::vector<int>& starts,
                             const std::vector<double>& rank_scale, bool record_timeline);

// All depths, ranked: feasible first by minibatch_time, then infeasible ones.
std::vector<Candidate> search(const SearchInput& in);

}  // namespace varuna
