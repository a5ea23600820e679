#include "search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <numeric>
#include <optional>
#include <queue>
#include <stdexcept>

namespace varuna {
namespace {

// Seconds each rank of a D-replica candidate reads data per mini-batch: its replica's examples.
double data_read_s(const SearchInput& in, int D) {
    return in.data_read_per_example * static_cast<double>(in.global_batch) / std::max(1, D);
}

// Whether stage s of a P-deep candidate recomputes (the per-stage override, else `recompute`).
bool rec_at(const SearchInput& in, int P, int s) {
    if (s >= P - 1) return false;
    return in.stage_recompute.size() == static_cast<std::size_t>(P) ? in.stage_recompute[static_cast<std::size_t>(s)]
                                                                    : in.recompute;
}

// In-flight bounds used while balancing, before the simulator gives exact peaks.
void stash_bound(const SearchInput& in, int P, int m, int s, int& stashed, int& live) {
    const bool last = s == P - 1;
    int inflight = m;
    if (in.policy == Policy::Varuna) inflight = std::min(m, 3 * (P - 1 - s) + 1);
    if (in.policy == Policy::OneFOneB) inflight = std::min(m, P - s);
    if (in.max_in_flight.size() == static_cast<std::size_t>(P) && in.max_in_flight[static_cast<std::size_t>(s)] > 0)
        inflight = std::min(inflight, in.max_in_flight[static_cast<std::size_t>(s)]);
    if (rec_at(in, P, s)) {
        stashed = inflight;
        live = 1;
    } else {
        stashed = 0;
        live = last && in.policy != Policy::GPipe ? 1 : inflight;
    }
    if (in.split_backward) live += std::min(m, P - s);  // graphs kept until their deferred W
}

// Backward seconds of segment k on a stage: the whole bwd, or with the split B + W, except on
// the first stage (no input gradient: its W is the whole backward).
double seg_bwd(const SearchInput& in, const SegmentTable& t, int k, bool first) {
    return in.split_backward && !first ? t.bwd_in[k] + t.wgt[k] : t.bwd[k];
}

double seg_cost(const SearchInput& in, const SegmentTable& t, int k, bool last, bool first = false) {
    double c = t.rec[k] + seg_bwd(in, t, k, first);
    if (in.recompute && !last) c += t.fwd[k];
    return c;
}

// Processor sharing: jobs of work[i] seconds (alone) start together on a host that runs
// `parallel` of them at full speed; each active job progresses at min(1, parallel / active).
// Returns each job's completion time.
std::vector<double> shared_completion(const std::vector<double>& work, double parallel) {
    const std::size_t n = work.size();
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return work[a] < work[b]; });
    std::vector<double> done(n, 0.0);
    double t = 0.0, progress = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
        const double active = static_cast<double>(n - i);
        const double rate = std::min(1.0, parallel / active);
        t += (work[order[i]] - progress) / rate;
        progress = work[order[i]];
        done[order[i]] = t;
    }
    return done;
}

// The byte count whose all-reduce among n ranks takes `seconds` (>= its own time): how a
// collective slowed down by shared cores is handed to the simulator (ring alpha-beta).
double stretched_bytes(double bytes, int n, double seconds, const SimConfig& cfg) {
    const double base = allreduce_time(bytes, n, cfg.ar_alpha, cfg.ar_beta);
    if (n <= 1 || bytes <= 0.0 || !(seconds > base) || !std::isfinite(cfg.ar_beta)) return bytes;
    return bytes + (seconds - base) * n / (2.0 * (n - 1)) * cfg.ar_beta;
}

// Synchronisation phase on hosts whose ranks share compute slots (cfg.compute_slots_per_host
// > 0: workers sharing a machine's cores).  The simulator runs a stage's all-reduces and
// optimizer as if alone; here they are stretched by the sharing of the host, all ranks
// entering each part together (the engine: DP all-reduce, tied all-reduces, world-wide
// consensus, then every rank's end of step at once):
//  * an all-reduce participant keeps in.ar_cpu_share of a core busy: the host's participants
//    share its slots (processor sharing);
//  * the end of step (norm, clipping, optimizer: memory-bound) runs at full speed on at most
//    in.opt_parallelism ranks of a host at once (memory bandwidth), never more than its slots.
void share_sync_phase(const SearchInput& in, SimConfig& cfg) {
    if (cfg.compute_slots_per_host <= 0) return;
    const int P = cfg.P, D = cfg.D, R = P * D;
    const int rph = std::max(1, cfg.ranks_per_host);
    const double slots = cfg.compute_slots_per_host;
    const double u = std::min(1.0, std::max(1e-3, in.ar_cpu_share));
    // per host, the completion of each rank's job of work(r) seconds (0 = none)
    auto per_host = [&](const std::vector<double>& work, double parallel) {
        std::vector<double> done(static_cast<std::size_t>(R), 0.0);
        for (int h = 0; h * rph < R; ++h) {
            std::vector<double> w;
            std::vector<int> who;
            for (int r = h * rph; r < std::min(R, (h + 1) * rph); ++r)
                if (work[static_cast<std::size_t>(r)] > 0.0) {
                    w.push_back(work[static_cast<std::size_t>(r)]);
                    who.push_back(r);
                }
            const std::vector<double> c = shared_completion(w, parallel);
            for (std::size_t i = 0; i < who.size(); ++i) done[static_cast<std::size_t>(who[i])] = c[i];
        }
        return done;
    };
    std::vector<double> work(static_cast<std::size_t>(R), 0.0);
    if (D > 1) {  // data-parallel all-reduces of every stage at once
        for (int r = 0; r < R; ++r)
            work[static_cast<std::size_t>(r)] =
                allreduce_time(cfg.dp_bytes[static_cast<std::size_t>(r % P)], D, cfg.ar_alpha, cfg.ar_beta);
        const std::vector<double> done = per_host(work, slots / u);
        for (int s = 0; s < P; ++s) {
            double t = 0.0;
            for (int d = 0; d < D; ++d) t = std::max(t, done[static_cast<std::size_t>(d * P + s)]);
            auto& b = cfg.dp_bytes[static_cast<std::size_t>(s)];
            b = stretched_bytes(b, D, t, cfg);
        }
    }
    for (auto& g : cfg.tied) {  // one tied group after the other, its members at once
        const int n = static_cast<int>(g.stages.size()) * D;
        std::fill(work.begin(), work.end(), 0.0);
        const double w = allreduce_time(g.bytes, n, cfg.ar_alpha, cfg.ar_beta);
        for (int d = 0; d < D; ++d)
            for (int s : g.stages) work[static_cast<std::size_t>(d * P + s)] = w;
        const std::vector<double> done = per_host(work, slots / u);
        g.bytes = stretched_bytes(g.bytes, n, *std::max_element(done.begin(), done.end()), cfg);
    }
    // every rank's end of step at once, after the consensus
    const double par = in.opt_parallelism > 0.0 ? std::min(slots, in.opt_parallelism) : slots;
    for (int r = 0; r < R; ++r) work[static_cast<std::size_t>(r)] = cfg.opt[static_cast<std::size_t>(r % P)];
    const std::vector<double> done = per_host(work, par);
    for (int s = 0; s < P; ++s) {
        double t = 0.0;
        for (int d = 0; d < D; ++d) t = std::max(t, done[static_cast<std::size_t>(d * P + s)]);
        cfg.opt[static_cast<std::size_t>(s)] = t;
    }
}

// Compute interference on hosts whose ranks share a machine (compute_slots_per_host > 0):
// each rank's compute runs 1 + in.compute_interference x (expected number of the host's
// other cores busy meanwhile) slower.  The expectation treats the other ranks of the host as
// independently busy for the fraction of the pipeline phase `busy` gives (their work over its
// length, from a first simulation), at most slots - 1 of them on other cores.  Returns the
// per-rank scales (empty when nothing changes).
std::vector<double> interference_scales(const SearchInput& in, const SimConfig& cfg, const SimResult& r) {
    const int P = cfg.P, R = P * cfg.D;
    const int rph = std::max(1, cfg.ranks_per_host), k = cfg.compute_slots_per_host;
    if (k <= 1 || in.compute_interference <= 0.0 || R < 2 || rph < 2 || !(r.pipeline_time > 0.0)) return {};
    std::vector<double> busy(static_cast<std::size_t>(R));
    for (int q = 0; q < R; ++q)
        busy[static_cast<std::size_t>(q)] =
            std::min(1.0, r.stage_busy[static_cast<std::size_t>(q % P)] / r.pipeline_time);
    std::vector<double> scale(static_cast<std::size_t>(R), 1.0);
    bool any = false;
    for (int q = 0; q < R; ++q) {
        const int h0 = (q / rph) * rph, h1 = std::min(R, h0 + rph);
        double others = 0.0;
        if (h1 - h0 > 64) {  // many ranks per host: the mean, capped, is close enough
            for (int j = h0; j < h1; ++j)
                if (j != q) others += busy[static_cast<std::size_t>(j)];
            others = std::min<double>(k - 1, others);
            scale[static_cast<std::size_t>(q)] = 1.0 + in.compute_interference * others;
            any = any || others > 0.0;
            continue;
        }
        std::vector<double> dist{1.0};  // distribution of the number of other busy ranks
        for (int j = h0; j < h1; ++j) {
            if (j == q) continue;
            const double b = busy[static_cast<std::size_t>(j)];
            std::vector<double> next(dist.size() + 1, 0.0);
            for (std::size_t x = 0; x < dist.size(); ++x) {
                next[x] += dist[x] * (1.0 - b);
                next[x + 1] += dist[x] * b;
            }
            dist.swap(next);
        }
        for (std::size_t x = 0; x < dist.size(); ++x) others += dist[x] * std::min<double>(k - 1, static_cast<double>(x));
        scale[static_cast<std::size_t>(q)] = 1.0 + in.compute_interference * others;
        any = any || others > 0.0;
    }
    return any ? scale : std::vector<double>{};
}

std::string gib(double bytes) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
    return buf;
}

}  // namespace

double stage_memory(const SearchInput& in, const SegmentTable& t, int a, int b, int stashed, int live) {
    double w = 0.0;
    for (int k = a; k < b; ++k) w += in.param_bytes[k];
    for (std::size_t i = 0; i < in.tied_segments.size(); ++i) {
        const auto& segs = in.tied_segments[i];
        const int first = *std::min_element(segs.begin(), segs.end());
        bool here = false;
        for (int k : segs) here = here || (k >= a && k < b);
        if (here && first < a) w += in.tied_bytes[i];  // a second copy of a tied weight
    }
    double act = 0.0;
    for (int k = a; k < b; ++k) act += t.act_bytes[k];
    const double input = a > 0 ? t.out_bytes[a - 1] : 0.0;
    return w * (2.0 + in.optimizer_state_factor) + stashed * input + live * (input + act);
}

namespace {

// balance(); *memory_bound (when given) says whether the memory check rejected any packing.  It
// did not => the same split for every m with at most as many micro-batches in flight (memory
// grows with them, so every check passes again and the packing decides the same way).
std::vector<int> balance_split(const SearchInput& in, const SegmentTable& t, int P, int m, bool* memory_bound) {
    if (memory_bound) *memory_bound = false;
    const int n = static_cast<int>(t.fwd.size());
    if (P < 1 || P > n) return {};
    double lo = 0.0, hi = 0.0;
    // prefix sums of seg_cost() on a stage that is not the last / on the last: a stage [a, b)
    // costs pre[b] - pre[a] (non-increasing in a: the costs are >= 0)
    std::vector<double> mid_pre(static_cast<std::size_t>(n) + 1, 0.0), last_pre(static_cast<std::size_t>(n) + 1, 0.0);
    std::vector<double> head_pre(static_cast<std::size_t>(n) + 1, 0.0);  // the first stage (split: W whole)
    for (int k = 0; k < n; ++k) {
        const double c = seg_cost(in, t, k, false);
        mid_pre[k + 1] = mid_pre[k] + c;
        last_pre[k + 1] = last_pre[k] + seg_cost(in, t, k, true);
        head_pre[k + 1] = head_pre[k] + seg_cost(in, t, k, P == 1, true);
        lo = std::max(lo, std::min(c, seg_cost(in, t, k, false, true)));
        hi += std::max(c, seg_cost(in, t, k, P == 1, true));
    }
    const std::vector<double>& first_pre = head_pre;
    // stage_memory() in O(1 + tied groups): prefix sums of parameter and activation bytes
    const bool limited = in.memory_limit > 0;
    std::vector<double> wsum, asum;
    std::vector<int> tied_first, tied_last;
    double tied_total = 0.0, out_max = 0.0;  // for a quick upper bound of a stage's memory
    if (limited) {
        for (double b : in.tied_bytes) tied_total += b;
        for (double b : t.out_bytes) out_max = std::max(out_max, b);
        wsum.assign(static_cast<std::size_t>(n) + 1, 0.0);
        asum.assign(static_cast<std::size_t>(n) + 1, 0.0);
        for (int k = 0; k < n; ++k) {
            wsum[k + 1] = wsum[k] + in.param_bytes[k];
            asum[k + 1] = asum[k] + t.act_bytes[k];
        }
        for (const auto& segs : in.tied_segments) {
            tied_first.push_back(*std::min_element(segs.begin(), segs.end()));
            tied_last.push_back(*std::max_element(segs.begin(), segs.end()));
        }
    }
    auto fits = [&](int a, int b, int stashed, int live) {
        double w = wsum[b] - wsum[a];
        for (std::size_t i = 0; i < in.tied_segments.size(); ++i) {
            if (tied_first[i] >= a || tied_last[i] < a) continue;  // no second copy here
            bool here = false;
            for (int k : in.tied_segments[i]) here = here || (k >= a && k < b);
            if (here) w += in.tied_bytes[i];
        }
        const double input = a > 0 ? t.out_bytes[a - 1] : 0.0;
        const double mem = w * (2.0 + in.optimizer_state_factor) + stashed * input + live * (input + asum[b] - asum[a]);
        if (mem <= in.memory_limit) return true;
        if (memory_bound) *memory_bound = true;
        return false;
    };
    // segments where no stage may start; a stage that would start there starts at the next allowed
    // one instead (shorter: still within T; the earlier stages take the rest)
    std::vector<char> forbidden(static_cast<std::size_t>(n) + 1, 0);
    for (int k : in.forbidden_starts)
        if (k > 0 && k < n) forbidden[k] = 1;
    // Greedy from the back (the last stage, which never recomputes, is known exactly).
    auto pack = [&](double T, std::vector<int>& starts) -> bool {
        starts.assign(P, 0);
        int end = n;
        for (int s = P - 1; s >= 1; --s) {
            int stashed, live;
            stash_bound(in, P, m, s, stashed, live);
            const std::vector<double>& pre = s == P - 1 ? last_pre : mid_pre;
            // at least one segment, and leave one for each earlier stage: the first a in
            // [s, end - 1] whose stage [a, end) costs <= T (galloping, then binary search)
            if (pre[end] - pre[end - 1] > T) return false;
            int a = end - 1, bad = s - 1;  // cost(a) <= T; every a' <= bad costs more (or is < s)
            for (int step = 1; a > s;) {
                const int probe = std::max(s, a - step);
                if (pre[end] - pre[probe] <= T) {
                    a = probe;
                    step *= 2;
                } else {
                    bad = probe;
                    break;
                }
            }
            while (a - bad > 1) {
                const int mid = bad + (a - bad) / 2;
                if (pre[end] - pre[mid] <= T) a = mid;
                else bad = mid;
            }
            // memory: when even an upper bound of [a, end)'s memory (all its weights, every tied
            // copy, the largest boundary tensor) fits, so does every shorter stage; else grow the
            // stage one segment at a time while it fits (memory is not monotone: the input varies)
            if (limited && (wsum[end] - wsum[a] + tied_total) * (2.0 + in.optimizer_state_factor) +
                                   (stashed + live) * out_max + live * (asum[end] - asum[a]) > in.memory_limit) {
                const int a_cost = a;
                a = end - 1;
                if (!fits(a, end, stashed, live)) return false;
                while (a - 1 >= a_cost && fits(a - 1, end, stashed, live)) --a;
            }
            while (a < end && forbidden[a]) ++a;
            if (a >= end || (limited && !fits(a, end, stashed, live))) return false;
            starts[s] = a;
            end = a;
        }
        if (first_pre[end] > T) return false;
        int stashed, live;
        stash_bound(in, P, m, 0, stashed, live);
        if (limited && !fits(0, end, stashed, live)) return false;
        starts[0] = 0;
        return true;
    };
    std::vector<int> best, trial;
    if (!pack(hi * (1 + 1e-9) + 1e-12, trial)) {
        // even one-segment-per-stage packing with unlimited bottleneck fails: memory
        return {};
    }
    best = trial;
    for (int it = 0; it < 60 && hi - lo > 1e-9 * hi; ++it) {
        const double mid = 0.5 * (lo + hi);
        if (pack(mid, trial)) {
            hi = mid;
            best = trial;
        } else {
            lo = mid;
        }
    }
    return best;
}

}  // namespace

std::vector<int> balance(const SearchInput& in, const SegmentTable& t, int P, int m) {
    return balance_split(in, t, P, m, nullptr);
}

// The simulator configuration of one candidate (stage costs, bytes, tied groups, placement)
// for its full m; fills c.stage_compute.
SimConfig candidate_config(const SearchInput& in, Candidate& c, const SegmentTable& t) {
    const int n = static_cast<int>(t.fwd.size());
    const int P = c.P, D = c.D;
    SimConfig cfg = in.sim;
    cfg.P = P;
    cfg.D = D;
    cfg.m = c.m;
    cfg.policy = in.policy;
    cfg.recompute = in.recompute;
    cfg.stage_recompute.clear();
    cfg.max_in_flight.clear();
    if (!in.stage_recompute.empty()) {
        validate_flags(P, in.stage_recompute);
        cfg.stage_recompute = in.stage_recompute;
    }
    if (!in.max_in_flight.empty()) {
        if (static_cast<int>(in.max_in_flight.size()) != P)
            throw std::invalid_argument("max_in_flight must have one cap per stage (P=" + std::to_string(P) + "), got " +
                                        std::to_string(in.max_in_flight.size()));
        cfg.max_in_flight = in.max_in_flight;
    }
    cfg.split_backward = in.split_backward;
    cfg.fwd.assign(P, 0.0);
    cfg.rec.assign(P, 0.0);
    cfg.bwd.assign(P, 0.0);
    cfg.wgt.assign(in.split_backward ? P : 0, 0.0);
    cfg.opt.assign(P, 0.0);
    cfg.dp_bytes.assign(P, 0.0);
    cfg.act_bytes.assign(P > 1 ? P - 1 : 0, 0.0);
    cfg.grad_bytes.clear();
    cfg.tied.clear();
    cfg.record_timeline = false;
    cfg.extrapolate = false;
    // ranks sharing a host's compute slots (workers on one machine's cores) are time-sliced,
    // as the OS does, rather than queued for a free slot; there an all-reduce started during
    // the backward competes with it for the cores, so no overlap is credited (one all-reduce
    // after the pipeline phase, stretched by its CPU share: share_sync_phase)
    cfg.time_share_slots = cfg.compute_slots_per_host > 0;
    if (cfg.compute_slots_per_host > 0) cfg.bucket_bytes = 0.0;
    std::vector<int> stage_of(n, 0);
    for (int s = 0; s < P; ++s) {
        const int a = c.starts[s], b = s + 1 < P ? c.starts[s + 1] : n;
        // a forward with autograd on (last stage, or no recompute) costs what a recompute costs
        const bool grad_forward = !rec_at(in, P, s);
        for (int k = a; k < b; ++k) {
            stage_of[k] = s;
            cfg.fwd[s] += grad_forward ? t.rec[k] : t.fwd[k];
            cfg.rec[s] += t.rec[k];
            if (!in.split_backward) {
                cfg.bwd[s] += t.bwd[k];
            } else if (s == 0) {  // no input gradient on the first stage: W is the whole backward
                cfg.wgt[s] += t.bwd[k];
            } else {
                cfg.bwd[s] += t.bwd_in[k];
                cfg.wgt[s] += t.wgt[k];
            }
            cfg.dp_bytes[s] += in.param_bytes[k];
        }
        if (s + 1 < P) cfg.act_bytes[s] = t.out_bytes[b - 1];
    }
    for (std::size_t i = 0; i < in.tied_segments.size(); ++i) {
        std::vector<int> stages;
        for (int k : in.tied_segments[i]) stages.push_back(stage_of[k]);
        std::sort(stages.begin(), stages.end());
        stages.erase(std::unique(stages.begin(), stages.end()), stages.end());
        if (stages.size() < 2) continue;
        cfg.dp_bytes[stages[0]] -= in.tied_bytes[i];  // synced in the tied group instead
        TiedGroup g;
        g.stages = stages;
        g.bytes = in.tied_bytes[i];
        cfg.tied.push_back(g);
    }
    for (int s = 0; s < P; ++s) {
        double w = cfg.dp_bytes[s];
        for (const auto& g : cfg.tied)
            if (std::find(g.stages.begin(), g.stages.end(), s) != g.stages.end()) w += g.bytes;
        cfg.dp_bytes[s] = std::max(0.0, cfg.dp_bytes[s]);
        cfg.opt[s] = in.opt_s_per_param_byte * w;
        c.stage_compute.push_back(cfg.rec[s] + cfg.bwd[s] + (in.split_backward ? cfg.wgt[s] : 0.0) +
                                  (rec_at(in, P, s) ? cfg.fwd[s] : 0.0));
    }
    share_sync_phase(in, cfg);
    cfg.data_read = data_read_s(in, c.D);
    cfg.data_prefetch = in.data_prefetch;
    return cfg;
}

namespace {

// A candidate's identity (no split yet): P, D, micro-batch size, m, idle GPUs.
Candidate new_candidate(const SearchInput& in, int P, int D, int ti) {
    const SegmentTable& t = in.tables.at(static_cast<std::size_t>(ti));
    Candidate c;
    c.P = P;
    c.D = D;
    c.micro_batch_size = t.micro_batch_size;
    c.m = in.global_batch / (t.micro_batch_size * D);
    c.idle_gpus = in.gpus - P * D;
    return c;
}

std::string no_split_reason(const SearchInput& in, int P, const SegmentTable& t) {
    const int n = static_cast<int>(t.fwd.size());
    int allowed = 0;  // segments a stage after the first may start at
    for (int k = 1; k < n; ++k)
        allowed += std::find(in.forbidden_starts.begin(), in.forbidden_starts.end(), k) == in.forbidden_starts.end();
    if (allowed < P - 1)
        return "no split into " + std::to_string(P) + " stages: a tensor skips cut-points (the model's forward uses it "
               "in a later segment), leaving " + std::to_string(allowed + 1) + " places to start a stage";
    return "no split into " + std::to_string(P) + " stages fits memory (" + gib(in.memory_limit) +
           " per GPU) at micro-batch " + std::to_string(t.micro_batch_size);
}

// Steady-state time per micro-batch that the schedule's order imposes beyond any one resource
// (run_candidate's rate takes the larger): with slow links a stage waits on transfers it cannot
// overlap.
//  * GPipe: every stage runs all its forwards before any backward, so the forward wave and the
//    backward wave follow each other: per micro-batch the slowest forward step (a stage's F or
//    a link's activation) plus the slowest backward step (a stage's R + B or a link's gradient).
//  * 1F1B: stage s holds at most k = P - s micro-batches in flight (F done, B not), and each
//    stays in flight for at least its round trip: its F and the F of every later stage, the
//    activation links, every later stage's backward and the gradient links back (Little's law:
//    at most k round trips at once).
//  * Varuna: its opportunistic forwards keep no fixed bound on what is in flight (0), except on
//    stages with an in-flight cap k (max_in_flight): there, as for 1F1B, k round trips at once.
double flow_rate(const SimConfig& cfg, Policy policy) {
    const int P = cfg.P;
    if (P < 2 || (policy == Policy::Varuna && cfg.max_in_flight.empty())) return 0.0;
    const StageFlags rec = stage_flags(cfg);
    const int rph = std::max(1, cfg.ranks_per_host);
    const double ov = cfg.action_overhead;
    std::vector<double> f(P), b(P), link(P, 0.0), glink(P, 0.0);
    for (int s = 0; s < P; ++s) {
        const bool last = s == P - 1;
        f[s] = cfg.fwd[s] + ov;
        b[s] = cfg.bwd[s] + ov + ((rec[static_cast<std::size_t>(s)] && !last) ? cfg.rec[s] + ov : 0.0);
        if (!last) {
            const bool local = (s / rph) == ((s + 1) / rph);
            const double a = local ? cfg.local_alpha : cfg.p2p_alpha;
            const double beta = local ? cfg.local_beta : cfg.p2p_beta;
            link[s] = a + cfg.act_bytes[s] / beta;
            glink[s] = a + (cfg.grad_bytes.empty() ? cfg.act_bytes[s] : cfg.grad_bytes[s]) / beta;
        }
    }
    if (policy == Policy::GPipe) {
        double fw = 0.0, bw = 0.0;
        for (int s = 0; s < P; ++s) {
            fw = std::max({fw, f[s], link[s]});
            bw = std::max({bw, b[s], glink[s]});
        }
        return fw + bw;
    }
    double rate = 0.0, trip = 0.0;  // trip: round trip of stage s, built from the last stage up
    for (int s = P - 1; s >= 0; --s) {
        trip += f[s] + b[s] + link[s] + glink[s];
        const int k = policy == Policy::Varuna ? cfg.max_in_flight[static_cast<std::size_t>(s)] : P - s;
        // with the split a micro-batch stays held until its W as well
        const double own_w = cfg.split_backward ? cfg.wgt[static_cast<std::size_t>(s)] + ov : 0.0;
        if (k > 0) rate = std::max(rate, (trip + own_w) / std::min(cfg.m, k));
    }
    return rate;
}

// Simulate a candidate whose split is set (c.starts) and whose simulator configuration (full m)
// is cfg; fills time, bubble, memory and feasibility.  actions += compute actions simulated.
Candidate run_candidate(const SearchInput& in, Candidate c, SimConfig cfg, const SegmentTable& t, long long* actions) {
    const int n = static_cast<int>(t.fwd.size());
    const int P = c.P, D = c.D;
    // Long mini-batches: simulate the first m_sim micro-batches (fill, warm-up and the start
    // of the steady state, where the peaks occur) and add (m - m_sim) times the steady-state
    // rate, which a work-conserving pipeline sets by its slowest resource: a stage's compute
    // per micro-batch, a link's transfer time, a host's compute divided by its slots, or what
    // the schedule's order imposes on top (flow_rate(): GPipe's two waves, 1F1B's round trips).
    const int m_sim = std::min(c.m, in.sim_cap > 0 ? in.sim_cap : std::max(P + 8, 64));
    // In-flight caps (max_in_flight): the steady state a cap lets through can be slower than any
    // one resource or flow_rate()'s round trips say (2x on a 56-stage pipeline capped at 3), so
    // a second, longer run measures it: the rate is at least what the window's tail took.
    const bool capped = std::any_of(cfg.max_in_flight.begin(), cfg.max_in_flight.end(), [](int k) { return k > 0; });
    const int tail = 12 * ((std::max(24, P) + 11) / 12);  // whole periods of 1, 2, 3, 4, 6 or 12
    const int m_tail = capped && m_sim < c.m ? std::min(c.m, m_sim + tail) : 0;
    double rate = 0.0;
    if (m_sim < c.m) {
        std::vector<double> host_work;
        const int rph = std::max(1, cfg.ranks_per_host);
        for (int s = 0; s < P; ++s) {
            const bool twice = rec_at(in, P, s);  // forward twice: F, then R
            const int acts = (twice ? 3 : 2) + (cfg.split_backward ? 1 : 0);
            const double work = cfg.fwd[s] + cfg.bwd[s] + (twice ? cfg.rec[s] : 0.0) +
                                (cfg.split_backward ? cfg.wgt[s] : 0.0) + acts * cfg.action_overhead;
            rate = std::max(rate, work);
            if (s + 1 < P) {
                const bool local = (s / rph) == ((s + 1) / rph);
                const double a = local ? cfg.local_alpha : cfg.p2p_alpha;
                const double b = local ? cfg.local_beta : cfg.p2p_beta;
                rate = std::max(rate, a + cfg.act_bytes[s] / b);
            }
            for (int d = 0; d < D; ++d) {
                const std::size_t h = static_cast<std::size_t>((d * P + s) / rph);
                if (host_work.size() <= h) host_work.resize(h + 1, 0.0);
                host_work[h] += work;
            }
        }
        if (cfg.shared_egress)  // a middle rank sends its activation and its gradient by one link
            for (int s = 1; s + 1 < P; ++s) {
                auto lat = [&](int to, double bytes) {
                    const bool local = (s / rph) == (to / rph);
                    return (local ? cfg.local_alpha : cfg.p2p_alpha) + bytes / (local ? cfg.local_beta : cfg.p2p_beta);
                };
                const double gb = cfg.grad_bytes.empty() ? cfg.act_bytes[s - 1] : cfg.grad_bytes[s - 1];
                rate = std::max(rate, lat(s + 1, cfg.act_bytes[s]) + lat(s - 1, gb));
            }
        if (cfg.compute_slots_per_host > 0)
            for (double w : host_work) rate = std::max(rate, w / cfg.compute_slots_per_host);
        rate = std::max(rate, flow_rate(cfg, in.policy));
        cfg.m = m_sim;
    }
    // the data read applies once to the whole mini-batch, after the steady-state extension
    const double read = cfg.data_read;
    cfg.data_read = 0.0;
    SimResult r = simulate(cfg);
    long long acts = r.events;
    const std::vector<double> scales = interference_scales(in, cfg, r);
    if (!scales.empty()) {
        cfg.rank_compute_scale = scales;
        r = simulate(cfg);
        acts += r.events;
        if (m_sim < c.m) rate *= *std::max_element(scales.begin(), scales.end());
    }
    double base = r.minibatch_time;  // the simulated part; the rest at the steady-state rate
    int simulated = m_sim;
    if (m_tail > m_sim) {
        SimConfig longer = cfg;
        longer.m = m_tail;
        const SimResult r2 = simulate(longer);
        acts += r2.events;
        rate = std::max(rate, (r2.minibatch_time - r.minibatch_time) / (m_tail - m_sim));
        base = r2.minibatch_time;
        simulated = m_tail;
    }
    if (actions) *actions += acts;
    const double compute = base + (c.m - simulated) * rate;
    c.minibatch_time = with_data_read(compute, read, cfg.data_prefetch);
    c.data_wait = c.minibatch_time - compute;
    c.bubble_fraction = r.bubble_fraction;
    if (m_sim < c.m) {  // bubbles shrink as the steady state grows
        double busy = 0.0;
        for (int s = 0; s < P; ++s) busy += r.stage_busy[s] + (c.m - m_sim) * (c.stage_compute[s] + 0.0);
        const double span = r.pipeline_time + (c.m - m_sim) * rate;
        c.bubble_fraction = span > 0 ? std::max(0.0, 1.0 - busy / (P * span)) : 0.0;
    }
    c.feasible = true;
    c.peak_stashed = r.peak_stashed;
    c.peak_live = r.peak_live;
    for (int s = 0; s < P; ++s) {
        const int a = c.starts[s], b = s + 1 < P ? c.starts[s + 1] : n;
        const double mem = stage_memory(in, t, a, b, r.peak_stashed[s], r.peak_live[s]);
        c.stage_memory.push_back(mem);
        if (in.memory_limit > 0 && mem > in.memory_limit && c.feasible) {
            c.feasible = false;
            c.reason = "stage " + std::to_string(s) + " needs " + gib(mem) + " > " + gib(in.memory_limit) +
                       " per GPU at micro-batch " + std::to_string(t.micro_batch_size);
        }
    }
    return c;
}

// Lower bound on run_candidate()'s minibatch_time for cfg (full m), from the simulator's rules
// (simulator.h) and run_candidate()'s steady-state extension; no simulation.  Every compute
// action of rank r lasts >= base + action_overhead (+ send_overhead): compute scales from
// interference are >= 1, and time-shared slots only stretch an action.  Ranks run one action
// at a time, so, for replica 0 with its host layout:
//  * stage s's first action waits for an activation that crossed every earlier stage:
//      pre[s] = sum_{j<s} (F_j + link_j),
//    and its m micro-batches keep it busy m * work_s, work_s = F + R + B + overheads per
//    micro-batch (no send overhead: run_candidate()'s rate leaves it out, and the rate,
//    >= work_s of every stage, extends the simulated prefix);  E[s] = pre[s] + m * work_s;
//  * link s -> s+1 carries m activations one after the other (alpha + bytes/beta each, also
//    in the rate): the last arrives >= pre[s] + F_s + m * link_s, then stage s+1 runs F, R, B
//    of it;
//  * stage s's last action is a B; its gradient reaches stage s-1, whose B follows:
//      X[s] = max(E[s], X[s+1] + glink_s + B_s);  done[s] >= X[s] + glink_{s-1} (the
//    runtime waits for its sends);
//  * then, as the simulator: the stage's data-parallel all-reduce (its last bucket at least;
//    the rest may overlap the backward), each tied group once its members are done, the
//    consensus, the largest optimizer step;
//  * on hosts with k compute slots (> 0) all the host's ranks' work (m * sum work) needs
//    >= its total / k (at most k actions progress at full speed at once).
// The result is shrunk by 1e-12 (relative) against rounding.
double time_lower_bound(const SimConfig& cfg) {
    const int P = cfg.P, D = cfg.D;
    const StageFlags flags = stage_flags(cfg);
    const double m = cfg.m;
    const int rph = std::max(1, cfg.ranks_per_host);
    const double ov = cfg.action_overhead, so = cfg.send_overhead;
    auto sz = [](int s) { return static_cast<std::size_t>(s); };
    std::vector<double> work(sz(P)), F(sz(P)), Rc(sz(P)), B(sz(P)), lat(sz(P), 0.0), glat(sz(P), 0.0);
    for (int s = 0; s < P; ++s) {
        const bool last = s == P - 1;
        const bool rec = flags[sz(s)] && !last;
        const double rbase = cfg.rec.empty() ? cfg.fwd[sz(s)] : cfg.rec[sz(s)];
        F[sz(s)] = cfg.fwd[sz(s)] + ov + (last ? 0.0 : so);
        Rc[sz(s)] = rec ? rbase + ov : 0.0;
        B[sz(s)] = cfg.bwd[sz(s)] + ov + (s > 0 ? so : 0.0);
        work[sz(s)] = cfg.fwd[sz(s)] + cfg.bwd[sz(s)] + (rec ? rbase : 0.0) + (rec ? 3 : 2) * ov +
                      (cfg.split_backward ? cfg.wgt[sz(s)] + ov : 0.0);
        if (!last) {
            const bool local = (s / rph) == ((s + 1) / rph);
            const double a = local ? cfg.local_alpha : cfg.p2p_alpha;
            const double beta = local ? cfg.local_beta : cfg.p2p_beta;
            const double ab = cfg.act_bytes.empty() ? 0.0 : cfg.act_bytes[sz(s)];
            const double gb = cfg.grad_bytes.empty() ? ab : cfg.grad_bytes[sz(s)];
            lat[sz(s)] = a + ab / beta;
            glat[sz(s)] = a + gb / beta;
        }
    }
    // E[s]: stage s's busy time ends (all its work); A[s]: its last micro-batch's F, R and B end
    std::vector<double> E(sz(P)), A(sz(P), 0.0), gstart(sz(P), 0.0);
    double pre = 0.0;
    for (int s = 0; s < P; ++s) {
        E[sz(s)] = std::max(E[sz(s)], pre + m * work[sz(s)]);
        // the last gradient-producing action (the last B, split: the last W) is the stage's final
        // action: it starts after every other one, each at least its base time plus overhead
        const double final_action = cfg.split_backward ? cfg.wgt[sz(s)] + ov : cfg.bwd[sz(s)] + ov;
        gstart[sz(s)] = std::max(0.0, pre + m * work[sz(s)] - final_action);
        if (s + 1 < P) {
            const double last_arrival = pre + F[sz(s)] + m * lat[sz(s)];
            A[sz(s + 1)] = last_arrival + F[sz(s + 1)] + Rc[sz(s + 1)] + B[sz(s + 1)];
            E[sz(s + 1)] = A[sz(s + 1)];
            pre += F[sz(s)] + lat[sz(s)];
        }
    }
    std::vector<double> cur(sz(P)), done_lb(sz(P));
    double X = 0.0;
    for (int s = P - 1; s >= 0; --s) {
        double done;
        if (!cfg.split_backward) {
            X = s == P - 1 ? E[sz(s)] : std::max(E[sz(s)], X + glat[sz(s)] + B[sz(s)]);
            done = X + (s > 0 ? glat[sz(s - 1)] : 0.0);
        } else {
            // the last B (which sends the last gradient) need not be the last action: a W may
            // follow it, so the chain of B's and the busy time bound the end separately
            X = s == P - 1 ? A[sz(s)] : std::max(A[sz(s)], X + glat[sz(s)] + B[sz(s)]);
            done = std::max(E[sz(s)], X + (s > 0 ? glat[sz(s - 1)] : 0.0));
        }
        const double dp = cfg.dp_bytes.empty() ? 0.0 : cfg.dp_bytes[sz(s)];
        // bucketed DP all-reduce: its last bucket follows the end of the pipeline phase, and the
        // whole of it the start of the final action (dp_allreduce_end with lower bounds of both)
        done_lb[sz(s)] = done;
        cur[sz(s)] = dp_allreduce_end(dp, D, done, gstart[sz(s)], cfg);
    }
    for (const auto& g : cfg.tied) {  // beside the DP all-reduce, once every member is done
        double start = 0.0;
        for (int s : g.stages) start = std::max(start, done_lb[sz(s)]);
        const double end = start + allreduce_time(g.bytes, static_cast<int>(g.stages.size()) * D, cfg.ar_alpha, cfg.ar_beta);
        for (int s : g.stages) cur[sz(s)] = std::max(cur[sz(s)], end);
    }
    double tail = static_cast<long long>(P) * D > 1 ? cfg.consensus_latency : 0.0;
    double opt = 0.0;
    for (double o : cfg.opt) opt = std::max(opt, o);
    tail += opt;
    double lb = *std::max_element(cur.begin(), cur.end()) + tail;
    if (cfg.compute_slots_per_host > 0) {
        std::vector<double> host;
        for (int r = 0; r < P * D; ++r) {
            const std::size_t h = sz(r / rph);
            if (host.size() <= h) host.resize(h + 1, 0.0);
            host[h] += work[sz(r % P)];
        }
        const double w = *std::max_element(host.begin(), host.end());
        lb = std::max(lb, m * w / cfg.compute_slots_per_host + tail);
    }
    return with_data_read(lb * (1.0 - 1e-12), cfg.data_read * (1.0 - 1e-12), cfg.data_prefetch);
}

// Split-free lower bound on evaluate()'s minibatch_time, valid for EVERY split into P stages (so
// it needs none), from per-table sums over segments k: v_k = R + B (what a segment costs any
// stage per micro-batch: a forward with autograd costs a recompute), u_k = min(F, R) + B (its
// forward and backward on a stage that is not the last), w_k = F + R + B with recompute, else
// v_k (on a stage that is not the last).  Every action also costs the overhead ov.
struct TableSums {
    double v = 0.0, u = 0.0, w = 0.0, f = 0.0, v_max = 0.0, tau = 1.0;
    double ratio = std::numeric_limits<double>::infinity();  // min v_k / F_k
};

TableSums table_sums(const SearchInput& in, const SegmentTable& t) {
    TableSums z;
    for (std::size_t k = 0; k < t.fwd.size(); ++k) {
        // split backward: a segment's backward costs bwd on the first stage and B + W elsewhere,
        // and only B stands between an upstream stage and its neighbour (W may wait): the bound
        // takes the smaller figures, valid wherever the segment lands
        const int kk = static_cast<int>(k);
        const double bw = in.split_backward ? std::min(t.bwd[k], seg_bwd(in, t, kk, false)) : t.bwd[k];
        const double v = t.rec[k] + bw;
        const double w = in.recompute ? t.fwd[k] + v : v;
        z.v += v;
        // the drain runs each stage's B; split, the first stage's is empty (its W may follow)
        z.u += std::min(t.fwd[k], t.rec[k]) + (in.split_backward ? 0.0 : t.bwd[k]);
        z.w += w;
        z.f += t.fwd[k];
        z.v_max = std::max(z.v_max, v);
        if (w > 0.0) z.tau = v > 0.0 ? std::max(z.tau, w / v) : std::numeric_limits<double>::infinity();
        if (t.fwd[k] > 0.0) z.ratio = std::min(z.ratio, v / t.fwd[k]);
    }
    return z;
}

// With y = sum of v_k over the last stage's segments:
//  (a) the last stage's busy time follows one micro-batch's F and precedes its B on every other
//      stage (fill and drain): T >= sum_{k not last} u_k + m y >= U + (m - 1) y, and T >= m y;
//  (b) the busiest other stage: T >= m (W - tau y) / (P - 1), tau = max w_k / v_k;
//  (c) every stage: T >= m max v_k and m V / P; with recompute, if the last stage holds
//      forwards worth x, the stages' total is >= sum(v + F) - x and the last stage alone
//      >= ratio x (ratio = min v_k / F_k): T >= m sum(v + F) / P * ratio P / (ratio P + 1);
// each stage's busy time also holds 2 m overheads.  (a) grows with y and (b) falls, so their
// minimum over y is where they cross (y >= 0).  Shrunk by 1e-12 (relative) against rounding.
double split_free_bound(const SearchInput& in, const TableSums& z, int P, int m) {
    const double ov = in.sim.action_overhead;
    if (P == 1) return m * (z.v + 2.0 * ov) * (1.0 - 1e-12);
    double c = std::max(z.v_max, z.v / P);
    if (in.recompute && z.f > 0.0) {
        const double all = (z.v + z.f) / P;
        c = std::max(c, std::isfinite(z.ratio) ? all * z.ratio * P / (z.ratio * P + 1.0) : all);
    }
    double fill = z.u;  // (a) and (b) at y = 0 when they do not cross
    if (std::isfinite(z.tau)) {
        const double c0 = m * z.w / (P - 1), d = m * z.tau / (P - 1);  // (b) = c0 - d y
        const double y1 = (c0 - z.u) / (m - 1 + d), y2 = c0 / (m + d);
        const double y = std::max(0.0, std::min(y1, y2));
        fill = std::max({z.u + (m - 1) * y, m * y, c0 - d * y});
    }
    return (std::max(m * c, fill) + 2.0 * m * ov) * (1.0 - 1e-12);
}

// The split a candidate uses: the user's, or balance() (memoised per micro-batch table and the
// in-flight count the memory check depends on; see stash_bound()).
struct SplitCache {
    struct Entry {
        int ti, key;
        bool memory_bound;
        std::vector<int> starts;
    };
    std::deque<Entry> done;
    long long runs = 0;  // balance() runs
    // The in-flight count the memory check of balance() depends on (0: none, no limit).
    static int key_of(const SearchInput& in, int P, int m) {
        if (in.memory_limit <= 0) return 0;
        if (in.policy == Policy::Varuna) return std::min(m, 3 * (P - 1) + 1);
        if (in.policy == Policy::OneFOneB) return std::min(m, P);
        return m;
    }
    // balance(in, table ti, P, m); m_max: the largest m this depth will ask for (tried first:
    // when memory never binds there, that split serves every smaller m).
    const std::vector<int>& get(const SearchInput& in, int P, int m, int ti, int m_max) {
        const int key = key_of(in, P, m);
        bool seen = false;
        for (const auto& e : done) {
            if (e.ti != ti) continue;
            seen = true;
            if (e.key == key || (e.key > key && !e.memory_bound)) return e.starts;
        }
        const SegmentTable& t = in.tables[static_cast<std::size_t>(ti)];
        if (!seen && key_of(in, P, m_max) > key) {
            Entry e{ti, key_of(in, P, m_max), false, {}};
            e.starts = balance_split(in, t, P, m_max, &e.memory_bound);
            ++runs;
            done.push_back(std::move(e));
            if (!done.back().memory_bound) return done.back().starts;
        }
        Entry e{ti, key, false, {}};
        e.starts = balance_split(in, t, P, m, &e.memory_bound);
        ++runs;
        done.push_back(std::move(e));
        return done.back().starts;
    }
};

// Ties on time: fewer GPUs (cheaper), then the larger micro-batch.
bool faster(const Candidate& a, const Candidate& b) {
    if (a.minibatch_time != b.minibatch_time) return a.minibatch_time < b.minibatch_time;
    if (a.D != b.D) return a.D < b.D;
    return a.micro_batch_size > b.micro_batch_size;
}

// Across depths (the order of the ranked rows): time, then the shallower pipeline, then faster().
bool faster_overall(const Candidate& a, const Candidate& b) {
    if (a.minibatch_time != b.minibatch_time) return a.minibatch_time < b.minibatch_time;
    if (a.P != b.P) return a.P < b.P;
    return faster(a, b);
}

// An infeasible row shows the reason of the candidate with the most replicas and the smallest
// micro-batch (the least memory per GPU).
bool shown_first(const Candidate& a, const Candidate& b) {
    if (a.D != b.D) return a.D > b.D;
    return a.micro_batch_size < b.micro_batch_size;
}

// One (D, micro-batch) of a depth.  key: its best known lower bound on the mini-batch time
// (split_free_bound() before its split, time_lower_bound() after).
struct Option {
    double key;
    int D, ti;
    bool split = false;
    Candidate c;
    SimConfig cfg;
};

// One pipeline depth P under search: its options, shared splits, the fastest simulated
// candidate and the reason an infeasible row shows.
struct Depth {
    int P = 0;
    std::vector<int> Ds;  // replica counts, most first
    SplitCache splits;
    std::vector<Option> opts;
    Candidate best, shown;
    bool have = false, have_shown = false;

    void show(const Candidate& c) {
        if (!have_shown || shown_first(c, shown)) shown = c;
        have_shown = true;
    }
    // An option with lower bound `key` (its P, D, micro-batch) as a candidate to compare.
    Candidate probe(const SearchInput& in, const Option& o) const {
        Candidate c;
        c.minibatch_time = o.key;
        c.P = P;
        c.D = o.D;
        c.micro_batch_size = in.tables[static_cast<std::size_t>(o.ti)].micro_batch_size;
        return c;
    }
    // Split option o (its key becomes its full bound); false when no split fits memory.
    bool split(const SearchInput& in, Option& o, SearchStats& st) {
        const SegmentTable& t = in.tables[static_cast<std::size_t>(o.ti)];
        o.split = true;
        o.c = new_candidate(in, P, o.D, o.ti);
        const int m_max = in.global_batch / (t.micro_batch_size * Ds.back());
        o.c.starts = !in.fixed_starts.empty() ? in.fixed_starts : splits.get(in, P, o.c.m, o.ti, m_max);
        if (o.c.starts.empty()) {
            ++st.split_failed;
            o.c.reason = no_split_reason(in, P, t);
            show(o.c);
            return false;
        }
        ++st.bounded;
        o.cfg = candidate_config(in, o.c, t);
        o.key = std::max(o.key, time_lower_bound(o.cfg));
        return true;
    }
    // Simulate a split option; keep it if it is this depth's fastest feasible one.
    void simulate(const SearchInput& in, Option& o, SearchStats& st) {
        ++st.simulated;
        Candidate c = run_candidate(in, std::move(o.c), std::move(o.cfg), in.tables[static_cast<std::size_t>(o.ti)],
                                    &st.actions);
        if (!c.feasible) {
            show(c);
        } else if (!have || faster(c, best)) {
            best = std::move(c);
            have = true;
        }
    }
    // The row of a depth none of whose candidates was simulated because none could beat the
    // fastest found elsewhere (best-only search): option o's identity (the smallest lower bound
    // left, kept as minibatch_time), infeasible, not simulated, no split.
    Candidate pruned_row(const SearchInput& in, const Option& o) const {
        Candidate c = new_candidate(in, P, o.D, o.ti);
        c.minibatch_time = o.key;
        c.simulated = false;
        c.reason = "pruned: cannot beat the fastest candidate found (best-only search)";
        return c;
    }
    // The row when no candidate is feasible.
    Candidate excluded_row(const SearchInput& in) const {
        if (have_shown) {
            Candidate c = shown;
            c.feasible = false;
            return c;
        }
        const int D = Ds.empty() ? 1 : Ds.front();
        Candidate c;
        c.P = P;
        c.D = D;
        c.idle_gpus = in.gpus - P * D;
        c.reason = "no candidate micro-batch size divides the replica batch " + std::to_string(in.global_batch / D) +
                   (Ds.size() > 1 ? " for any replica count D <= " + std::to_string(D) : "");
        return c;
    }
};

}  // namespace

Candidate evaluate(const SearchInput& in, int P, int D, int ti) {
    const SegmentTable& t = in.tables.at(static_cast<std::size_t>(ti));
    Candidate c = new_candidate(in, P, D, ti);
    c.starts = !in.fixed_starts.empty() ? in.fixed_starts : balance(in, t, P, c.m);
    if (c.starts.empty()) {
        c.reason = no_split_reason(in, P, t);
        return c;
    }
    SimConfig cfg = candidate_config(in, c, t);
    return run_candidate(in, std::move(c), std::move(cfg), t, nullptr);
}

double candidate_lower_bound(const SearchInput& in, int P, int D, int ti, bool split_free, bool any_recompute) {
    if (any_recompute) {
        // recompute on: every stage but the last forwards without autograd (the cheaper forward);
        // for the split-free sums recompute off (u takes the cheaper forward, w = v the least work)
        SearchInput x = in;
        x.recompute = !split_free;
        x.stage_recompute.clear();
        x.max_in_flight.clear();
        if (split_free) return candidate_lower_bound(x, P, D, ti, true, false);
        const SegmentTable& t = x.tables.at(static_cast<std::size_t>(ti));
        Candidate c = new_candidate(x, P, D, ti);
        c.starts = !x.fixed_starts.empty() ? x.fixed_starts : balance(x, t, P, c.m);
        if (c.starts.empty()) return std::numeric_limits<double>::infinity();
        SimConfig cfg = candidate_config(x, c, t);
        cfg.recompute = false;  // ... and no recompute action: a stage's busy time is its forward and backward
        cfg.stage_recompute.assign(static_cast<std::size_t>(P), false);
        return time_lower_bound(cfg);
    }
    const SegmentTable& t = in.tables.at(static_cast<std::size_t>(ti));
    Candidate c = new_candidate(in, P, D, ti);
    if (split_free)
        return with_data_read(split_free_bound(in, table_sums(in, t), P, c.m), data_read_s(in, D) * (1.0 - 1e-12),
                              in.data_prefetch);
    c.starts = !in.fixed_starts.empty() ? in.fixed_starts : balance(in, t, P, c.m);
    if (c.starts.empty()) return std::numeric_limits<double>::infinity();
    return time_lower_bound(candidate_config(in, c, t));
}

SimResult simulate_candidate(const SearchInput& in, int P, int D, int ti, const std::vector<int>& starts,
                             const std::vector<double>& rank_scale, bool record_timeline) {
    const SegmentTable& t = in.tables.at(static_cast<std::size_t>(ti));
    const int n = static_cast<int>(t.fwd.size());
    if (P < 1 || D < 1) throw std::invalid_argument("P and D must be >= 1");
    if (static_cast<int>(starts.size()) != P || starts.empty() || starts[0] != 0)
        throw std::invalid_argument("starts must hold P first-segment indices beginning at 0");
    for (int s = 1; s < P; ++s)
        if (starts[s] <= starts[s - 1] || starts[s] >= n) throw std::invalid_argument("starts must increase within the segments");
    if (!rank_scale.empty() && static_cast<int>(rank_scale.size()) != P * D)
        throw std::invalid_argument("rank_scale must have P*D entries");
    Candidate c;
    c.P = P;
    c.D = D;
    c.micro_batch_size = t.micro_batch_size;
    c.m = in.global_batch / (t.micro_batch_size * D);
    if (c.m < 1) throw std::invalid_argument("global batch smaller than micro-batch x D");
    c.starts = starts;
    SimConfig cfg = candidate_config(in, c, t);
    cfg.record_timeline = record_timeline;
    SimResult r = simulate(cfg);
    std::vector<double> scales = interference_scales(in, cfg, r);
    if (!rank_scale.empty()) {
        if (scales.empty()) scales.assign(static_cast<std::size_t>(P * D), 1.0);
        for (std::size_t q = 0; q < scales.size(); ++q) scales[q] *= rank_scale[q];
    }
    if (!scales.empty()) {
        cfg.rank_compute_scale = scales;
        r = simulate(cfg);
    }
    return r;
}

std::vector<Candidate> search(const SearchInput& in, SearchStats* stats) {
    if (in.gpus < 1) throw std::invalid_argument("gpus must be >= 1");
    if (in.global_batch < 1) throw std::invalid_argument("global_batch must be >= 1");
    if (in.tables.empty()) throw std::invalid_argument("no micro-batch sizes to search");
    if (!(std::isfinite(in.data_read_per_example) && in.data_read_per_example >= 0.0))
        throw std::invalid_argument("data_read_per_example (seconds to read one example) must be a finite number >= 0");
    const int n = static_cast<int>(in.tables[0].fwd.size());
    for (const auto& t : in.tables) {
        if (static_cast<int>(t.fwd.size()) != n || static_cast<int>(t.rec.size()) != n ||
            static_cast<int>(t.bwd.size()) != n || static_cast<int>(t.out_bytes.size()) != n ||
            static_cast<int>(t.act_bytes.size()) != n || t.micro_batch_size < 1)
            throw std::invalid_argument("every micro-batch table needs fwd/rec/bwd/out_bytes/act_bytes of one length");
        if (in.split_backward &&
            (static_cast<int>(t.bwd_in.size()) != n || static_cast<int>(t.wgt.size()) != n))
            throw std::invalid_argument("split_backward needs bwd_in and wgt (the split backward's B and W per "
                                        "segment) in every micro-batch table; calibrate the split or pass "
                                        "split_backward=false");
    }
    validate_split(in.policy, in.split_backward);
    if (!in.stage_recompute.empty() || !in.max_in_flight.empty())
        throw std::invalid_argument("search() takes one recompute setting for every depth; per-stage recompute and "
                                    "in-flight caps apply to evaluate() of one depth (leave them empty)");
    if (static_cast<int>(in.param_bytes.size()) != n)
        throw std::invalid_argument("param_bytes must have one entry per segment");
    if (in.fixed_replicas < 0 || in.fixed_replicas > in.gpus ||
        (in.fixed_replicas > 0 && in.global_batch % in.fixed_replicas != 0))
        throw std::invalid_argument("fixed_replicas must be 0 (choose) or a divisor of global_batch <= gpus");
    SearchStats st;
    std::vector<Candidate> out;
    int maxP = std::min(in.gpus, n);
    if (in.max_depth > 0) maxP = std::min(maxP, in.max_depth);
    if (in.fixed_replicas > 0) maxP = std::min(maxP, in.gpus / in.fixed_replicas);
    int minP = 1;
    if (!in.fixed_starts.empty()) minP = maxP = static_cast<int>(in.fixed_starts.size());
    // micro-batch tables from the largest size down
    std::vector<int> order(in.tables.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) {
        return in.tables[static_cast<std::size_t>(a)].micro_batch_size >
               in.tables[static_cast<std::size_t>(b)].micro_batch_size;
    });
    std::vector<TableSums> sums;
    for (const auto& t : in.tables) sums.push_back(table_sums(in, t));
    // Pop order of options (best first): the smaller key, then the order faster_overall() prefers.
    std::vector<Depth> depths;
    auto later = [&](std::pair<int, int> x, std::pair<int, int> y) {
        const Depth &dx = depths[static_cast<std::size_t>(x.first)], &dy = depths[static_cast<std::size_t>(y.first)];
        const Option &a = dx.opts[static_cast<std::size_t>(x.second)], &b = dy.opts[static_cast<std::size_t>(y.second)];
        if (a.key != b.key) return a.key > b.key;
        return faster_overall(dy.probe(in, b), dx.probe(in, a));
    };
    using Queue = std::priority_queue<std::pair<int, int>, std::vector<std::pair<int, int>>, decltype(later)>;
    for (int P = minP; P <= maxP; ++P) {
        Depth d;
        d.P = P;
        if (in.fixed_replicas > 0) {
            d.Ds.push_back(in.fixed_replicas);
        } else {
            for (int D = in.gpus / P; D >= 1; --D)
                if (in.global_batch % D == 0) d.Ds.push_back(D);
        }
        for (int D : d.Ds)
            for (int ti : order) {
                const int b = in.tables[static_cast<std::size_t>(ti)].micro_batch_size;
                if ((in.global_batch / D) % b != 0) continue;
                const int m = in.global_batch / (b * D);
                const double key = with_data_read(split_free_bound(in, sums[static_cast<std::size_t>(ti)], P, m),
                                                  data_read_s(in, D) * (1.0 - 1e-12), in.data_prefetch);
                d.opts.push_back(Option{key, D, ti, false, {}, {}});
            }
        st.candidates += static_cast<long long>(d.opts.size());
        depths.push_back(std::move(d));
    }
    st.depths = static_cast<long long>(depths.size());
    std::vector<std::optional<Candidate>> pruned(depths.size());  // best-only: rows never simulated
    if (in.exhaustive) {
        // One depth at a time, best first: the option with the smallest key is split (its key
        // becomes its full bound) or, once split, simulated; stop when no key can beat the
        // depth's best time.
        for (int di = 0; di < static_cast<int>(depths.size()); ++di) {
            Depth& d = depths[static_cast<std::size_t>(di)];
            Queue queue(later);
            for (int i = 0; i < static_cast<int>(d.opts.size()); ++i) queue.push({di, i});
            while (!queue.empty()) {
                const int i = queue.top().second;
                Option& o = d.opts[static_cast<std::size_t>(i)];
                if (d.have && !faster(d.probe(in, o), d.best)) {
                    st.pruned += static_cast<long long>(queue.size());  // every other key is >= this one
                    break;
                }
                queue.pop();
                if (!o.split) {
                    if (d.split(in, o, st)) queue.push({di, i});
                    continue;
                }
                d.simulate(in, o, st);
            }
        }
    } else {
        // Best first over every depth's options at once: stop when no key can beat the fastest
        // candidate found anywhere.  A depth's row is then its fastest simulated candidate (exact
        // time, not necessarily its depth's fastest), else, with options left, a pruned row.
        Queue queue(later);
        for (int di = 0; di < static_cast<int>(depths.size()); ++di)
            for (int i = 0; i < static_cast<int>(depths[static_cast<std::size_t>(di)].opts.size()); ++i)
                queue.push({di, i});
        Candidate top;
        bool have_top = false;
        while (!queue.empty()) {
            const auto [di, i] = queue.top();
            Depth& d = depths[static_cast<std::size_t>(di)];
            Option& o = d.opts[static_cast<std::size_t>(i)];
            if (have_top && !faster_overall(d.probe(in, o), top)) break;
            queue.pop();
            if (!o.split) {
                if (d.split(in, o, st)) queue.push({di, i});
                continue;
            }
            d.simulate(in, o, st);
            if (d.have && (!have_top || faster_overall(d.best, top))) {
                top = d.best;
                have_top = true;
            }
        }
        st.pruned += static_cast<long long>(queue.size());
        for (; !queue.empty(); queue.pop()) {  // popped smallest key first: a depth's first is its bound
            const auto [di, i] = queue.top();
            Depth& d = depths[static_cast<std::size_t>(di)];
            auto& row = pruned[static_cast<std::size_t>(di)];
            if (d.have || row) continue;
            row = d.pruned_row(in, d.opts[static_cast<std::size_t>(i)]);
            ++st.pruned_rows;
        }
    }
    for (std::size_t di = 0; di < depths.size(); ++di) {
        Depth& d = depths[di];
        out.push_back(d.have ? std::move(d.best) : pruned[di] ? std::move(*pruned[di]) : d.excluded_row(in));
        st.splits += d.splits.runs;
    }
    std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
        if (a.feasible != b.feasible) return a.feasible;
        if (a.feasible) return a.minibatch_time < b.minibatch_time;
        return a.P < b.P;
    });
    if (stats) *stats = st;
    return out;
}

}  // namespace varuna
