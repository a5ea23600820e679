#include "search.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <stdexcept>

namespace varuna {
namespace {

// In-flight bounds used while balancing, before the simulator gives exact peaks.
void stash_bound(const SearchInput& in, int P, int m, int s, int& stashed, int& live) {
    const bool last = s == P - 1;
    int inflight = m;
    if (in.policy == Policy::Varuna) inflight = std::min(m, 3 * (P - 1 - s) + 1);
    if (in.policy == Policy::OneFOneB) inflight = std::min(m, P - s);
    if (in.recompute && !last) {
        stashed = inflight;
        live = 1;
    } else {
        stashed = 0;
        live = last && in.policy != Policy::GPipe ? 1 : inflight;
    }
}

double seg_cost(const SearchInput& in, const SegmentTable& t, int k, bool last) {
    double c = t.rec[k] + t.bwd[k];
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

std::vector<int> balance(const SearchInput& in, const SegmentTable& t, int P, int m) {
    const int n = static_cast<int>(t.fwd.size());
    if (P < 1 || P > n) return {};
    double lo = 0.0, hi = 0.0;
    for (int k = 0; k < n; ++k) {
        lo = std::max(lo, seg_cost(in, t, k, false));
        hi += seg_cost(in, t, k, false);
    }
    // Greedy from the back (the last stage, which never recomputes, is known exactly).
    auto pack = [&](double T, std::vector<int>& starts) -> bool {
        starts.assign(P, 0);
        int end = n;
        for (int s = P - 1; s >= 1; --s) {
            int stashed, live;
            stash_bound(in, P, m, s, stashed, live);
            const bool last = s == P - 1;
            int a = end - 1;  // at least one segment
            double cost = seg_cost(in, t, a, last);
            if (cost > T) return false;
            if (in.memory_limit > 0 && stage_memory(in, t, a, end, stashed, live) > in.memory_limit) return false;
            while (a - 1 >= s) {  // leave one segment for each earlier stage
                const double c2 = cost + seg_cost(in, t, a - 1, last);
                if (c2 > T) break;
                if (in.memory_limit > 0 && stage_memory(in, t, a - 1, end, stashed, live) > in.memory_limit) break;
                cost = c2;
                --a;
            }
            starts[s] = a;
            end = a;
        }
        double cost0 = 0.0;
        for (int k = 0; k < end; ++k) cost0 += seg_cost(in, t, k, P == 1);
        if (cost0 > T) return false;
        int stashed, live;
        stash_bound(in, P, m, 0, stashed, live);
        if (in.memory_limit > 0 && stage_memory(in, t, 0, end, stashed, live) > in.memory_limit) return false;
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
    cfg.fwd.assign(P, 0.0);
    cfg.rec.assign(P, 0.0);
    cfg.bwd.assign(P, 0.0);
    cfg.opt.assign(P, 0.0);
    cfg.dp_bytes.assign(P, 0.0);
    cfg.act_bytes.assign(P > 1 ? P - 1 : 0, 0.0);
    cfg.grad_bytes.clear();
    cfg.tied.clear();
    cfg.record_timeline = false;
    cfg.extrapolate = false;
    // ranks sharing a host's compute slots (workers on one machine's cores) are time-sliced,
    // as the OS does, rather than queued for a free slot
    cfg.time_share_slots = cfg.compute_slots_per_host > 0;
    std::vector<int> stage_of(n, 0);
    for (int s = 0; s < P; ++s) {
        const int a = c.starts[s], b = s + 1 < P ? c.starts[s + 1] : n;
        // a forward with autograd on (last stage, or no recompute) costs what a recompute costs
        const bool grad_forward = !in.recompute || s == P - 1;
        for (int k = a; k < b; ++k) {
            stage_of[k] = s;
            cfg.fwd[s] += grad_forward ? t.rec[k] : t.fwd[k];
            cfg.rec[s] += t.rec[k];
            cfg.bwd[s] += t.bwd[k];
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
        c.stage_compute.push_back(cfg.rec[s] + cfg.bwd[s] + (in.recompute && s + 1 < P ? cfg.fwd[s] : 0.0));
    }
    share_sync_phase(in, cfg);
    return cfg;
}

Candidate evaluate(const SearchInput& in, int P, int D, int ti) {
    const SegmentTable& t = in.tables.at(static_cast<std::size_t>(ti));
    const int n = static_cast<int>(t.fwd.size());
    Candidate c;
    c.P = P;
    c.D = D;
    c.micro_batch_size = t.micro_batch_size;
    c.m = in.global_batch / (t.micro_batch_size * D);
    c.idle_gpus = in.gpus - P * D;
    if (!in.fixed_starts.empty()) {
        c.starts = in.fixed_starts;
    } else {
        c.starts = balance(in, t, P, c.m);
    }
    if (c.starts.empty()) {
        c.reason = "no split into " + std::to_string(P) + " stages fits memory (" + gib(in.memory_limit) +
                   " per GPU) at micro-batch " + std::to_string(t.micro_batch_size);
        return c;
    }
    SimConfig cfg = candidate_config(in, c, t);
    // Long mini-batches: simulate the first m_sim micro-batches (fill, warm-up and the start
    // of the steady state, where the peaks occur) and add (m - m_sim) times the steady-state
    // rate, which a work-conserving pipeline sets by its slowest resource: a stage's compute
    // per micro-batch, a link's transfer time, or a host's compute divided by its slots.
    const int m_sim = std::min(c.m, in.sim_cap > 0 ? in.sim_cap : std::max(P + 8, 64));
    double rate = 0.0;
    if (m_sim < c.m) {
        const bool fwd_twice = in.recompute;
        std::vector<double> host_work;
        const int rph = std::max(1, cfg.ranks_per_host);
        for (int s = 0; s < P; ++s) {
            const bool last = s == P - 1;
            const int actions = (fwd_twice && !last) ? 3 : 2;
            const double work = cfg.fwd[s] + cfg.bwd[s] + ((fwd_twice && !last) ? cfg.rec[s] : 0.0) +
                                actions * cfg.action_overhead;
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
        if (cfg.compute_slots_per_host > 0)
            for (double w : host_work) rate = std::max(rate, w / cfg.compute_slots_per_host);
        cfg.m = m_sim;
    }
    SimResult r = simulate(cfg);
    const std::vector<double> scales = interference_scales(in, cfg, r);
    if (!scales.empty()) {
        cfg.rank_compute_scale = scales;
        r = simulate(cfg);
        if (m_sim < c.m) rate *= *std::max_element(scales.begin(), scales.end());
    }
    c.minibatch_time = r.minibatch_time + (c.m - m_sim) * rate;
    c.bubble_fraction = r.bubble_fraction;
    if (m_sim < c.m) {  // bubbles shrink as the steady state grows
        double busy = 0.0;
        for (int s = 0; s < P; ++s) busy += r.stage_busy[s] + (c.m - m_sim) * (c.stage_compute[s] + 0.0);
        const double span = r.pipeline_time + (c.m - m_sim) * rate;
        c.bubble_fraction = span > 0 ? std::max(0.0, 1.0 - busy / (P * span)) : 0.0;
    }
    c.feasible = true;
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

std::vector<Candidate> search(const SearchInput& in) {
    if (in.gpus < 1) throw std::invalid_argument("gpus must be >= 1");
    if (in.global_batch < 1) throw std::invalid_argument("global_batch must be >= 1");
    if (in.tables.empty()) throw std::invalid_argument("no micro-batch sizes to search");
    const int n = static_cast<int>(in.tables[0].fwd.size());
    for (const auto& t : in.tables) {
        if (static_cast<int>(t.fwd.size()) != n || static_cast<int>(t.rec.size()) != n ||
            static_cast<int>(t.bwd.size()) != n || static_cast<int>(t.out_bytes.size()) != n ||
            static_cast<int>(t.act_bytes.size()) != n || t.micro_batch_size < 1)
            throw std::invalid_argument("every micro-batch table needs fwd/rec/bwd/out_bytes/act_bytes of one length");
    }
    if (static_cast<int>(in.param_bytes.size()) != n)
        throw std::invalid_argument("param_bytes must have one entry per segment");
    std::vector<Candidate> out;
    int maxP = std::min(in.gpus, n);
    if (in.max_depth > 0) maxP = std::min(maxP, in.max_depth);
    int minP = 1;
    if (!in.fixed_starts.empty()) minP = maxP = static_cast<int>(in.fixed_starts.size());
    for (int P = minP; P <= maxP; ++P) {
        int D = in.gpus / P;
        while (D > 1 && in.global_batch % D != 0) --D;
        Candidate best;
        bool have = false;
        std::string first_reason;
        // Micro-batch size: from the largest that fits memory down (larger micro-batches run
        // the hardware more efficiently), simulated, until one leaves m >= 2P micro-batches
        // (enough to fill the pipeline); the fastest of those tried wins.
        std::vector<int> order(in.tables.size());
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int a, int b) {
            return in.tables[static_cast<std::size_t>(a)].micro_batch_size >
                   in.tables[static_cast<std::size_t>(b)].micro_batch_size;
        });
        for (int ti : order) {
            const int b = in.tables[static_cast<std::size_t>(ti)].micro_batch_size;
            if ((in.global_batch / D) % b != 0 || in.global_batch % D != 0) continue;
            Candidate c = evaluate(in, P, D, ti);
            if (c.feasible) {
                if (!have || c.minibatch_time < best.minibatch_time) best = c;
                have = true;
                if (c.m >= 2 * P) break;
            } else if (!have) {
                first_reason = c.reason;  // ends as the smallest size's reason
                best = c;
            }
        }
        if (!have) {
            if (best.P == 0) {
                best.P = P;
                best.D = D;
                best.idle_gpus = in.gpus - P * D;
                best.reason = "no candidate micro-batch size divides the replica batch " +
                              std::to_string(in.global_batch / D);
            } else {
                best.reason = first_reason;
            }
            best.feasible = false;
        }
        out.push_back(best);
    }
    std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
        if (a.feasible != b.feasible) return a.feasible;
        if (a.feasible) return a.minibatch_time < b.minibatch_time;
        return a.P < b.P;
    });
    return out;
}

}  // namespace varuna
