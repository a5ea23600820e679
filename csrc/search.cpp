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
