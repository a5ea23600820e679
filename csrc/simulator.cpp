// Discrete-event simulator of one mini-batch.  See simulator.h for the model.
#include "simulator.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <numeric>
#include <queue>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace varuna {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTwoPi = 6.283185307179586476925286766559;
// Extrapolation constants (see simulator.h).  Varuna's stage 0 runs ~4P forwards
// ahead of its backwards, so its steady state needs runs of ~5P.
constexpr int kVarunaSkip = 4;   // forward warm-up length in units of P (others: 1)
constexpr int kCapAdd = 32;      // cap = (skip + 1) * P + kCapAdd
constexpr int kWindowSlack = 4;  // extra micro-batches skipped at each window end
constexpr int kAlign = 12;       // run lengths = m (mod 12): periods 1, 2, 3, 4, 6, 12 need no extra run
constexpr int kMaxPeriod = 64;   // longest period looked for
constexpr int kMinRun = 24;      // shortest periodic stretch accepted

std::string num(double x) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", x);
    return buf;
}

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

void check_nonneg(double x, const std::string& name, const char* unit) {
    if (!(x >= 0.0) || !std::isfinite(x))
        bad(name + " must be a finite number >= 0 " + unit + ", got " + num(x));
}

void check_vec(const std::vector<double>& v, const char* name, std::size_t want, bool may_be_empty,
               const char* what, const char* unit, std::size_t alt = 0) {
    if (v.empty() && may_be_empty) return;
    if (v.size() != want && !(alt != 0 && v.size() == alt)) {
        std::string msg = std::string(name) + " must have " + std::to_string(want) +
                          (alt != 0 ? " or " + std::to_string(alt) : std::string()) + " entries (" + what +
                          ")" + (may_be_empty ? " or be empty" : "") + ", got " + std::to_string(v.size());
        bad(msg);
    }
    for (std::size_t i = 0; i < v.size(); ++i)
        check_nonneg(v[i], std::string(name) + "[" + std::to_string(i) + "]", unit);
}

void check_beta(double b, const char* name) {
    if (!(b > 0.0)) bad(std::string(name) + " (bandwidth, bytes/s) must be > 0 (inf = free), got " + num(b));
}

// Reproducible normal deviates: mt19937_64 is fully specified by the standard, and
// Box-Muller is spelled out here (std::normal_distribution is implementation-defined).
class Rng {
public:
    explicit Rng(std::uint64_t seed) : g_(seed) {}
    double normal() {
        if (has_spare_) {
            has_spare_ = false;
            return spare_;
        }
        double u1;
        do u1 = uniform(); while (u1 <= 0.0);
        const double u2 = uniform();
        const double r = std::sqrt(-2.0 * std::log(u1));
        spare_ = r * std::sin(kTwoPi * u2);
        has_spare_ = true;
        return r * std::cos(kTwoPi * u2);
    }

private:
    double uniform() { return static_cast<double>(g_() >> 11) * 0x1.0p-53; }
    std::mt19937_64 g_;
    bool has_spare_ = false;
    double spare_ = 0.0;
};

// Result of the pipeline phase of one simulation (nrep replicas, m micro-batches).
struct PipelineRun {
    int nrep = 1;
    int m = 1;
    int engine = 0;            // 1 event, 2 fast
    std::vector<double> done;  // per simulated rank
    std::vector<double> busy;
    std::vector<int> peak_stashed, peak_live, peak_inflight;
    std::vector<double> grad_start;  // per simulated rank: start of its last B (split: W)
    // Only for extrapolation (replica 0, [stage * m + i]): start of F(i) and of B(i), and
    // the in-flight count at the start of F(i).
    std::vector<double> f_start, b_start;
    std::vector<int> f_count;
    long long actions = 0;
    std::vector<std::vector<Segment>> timeline;
    std::vector<Transfer> transfers;
};

// ---------------------------------------------------------------------------------
// Two engines share the rank state and the action / message bookkeeping:
//
//  * run_events(): the general discrete-event loop (priority queue); handles compute
//    slots and jitter.
//  * run_fast(): conservative, heap-free.  Without slots and jitter ranks interact
//    only through messages, so a rank may decide at its free time t as soon as the
//    number of messages arriving by t is certain: either a message already sent
//    arrives after t (links are FIFO), or all were sent, or a lower bound on the
//    sender's next arrival exceeds t.  The bound follows the sender's state: free at
//    t_u -> t_u + (duration of a sending action) + latency; blocked on its own input
//    -> bound of that input (recursively) + the blocked action + ...  Ranks are swept
//    alternately forward and backward until all are done.  Every decision sees
//    exactly the counts the event loop gives it, so results are bit-identical (tests
//    compare the two).  It needs a positive lookahead (every sending action or link
//    takes > 0 s); if a sweep ever makes no progress it reports a stall and the
//    caller reruns with run_events().
class Engine {
public:
    Engine(const SimConfig& cfg, int m, int nrep, bool steady = false)
        : c_(cfg), P_(cfg.P), m_(m), nrep_(nrep), rng_(cfg.seed), steady_(steady) {
        setup();
    }

    PipelineRun run_events();
    bool run_fast(PipelineRun& out);  // false: stalled (state is then unusable)
    // True when run_fast can be used: no slot contention, no jitter, positive lookahead.
    bool fast_applicable() const;

private:
    enum Prio : std::uint64_t { kEnd = 0, kReady = 1, kDecide = 2 };
    struct Event {
        double t;
        std::uint64_t key;  // prio << 32 | rank
    };
    struct EvLater {
        bool operator()(const Event& a, const Event& b) const {
            return a.t > b.t || (a.t == b.t && a.key > b.key);
        }
    };
    struct Rank {
        int stage = 0, host = 0;
        Action cur{ActionKind::Forward, 0};
        double t_free = 0.0;      // when it last became free (decision time)
        double wait_start = 0.0;  // slot request time
        int waiting_kind = -1;    // -1 none, 0 activation, 1 gradient
        int waiting_mb = -1;
        bool finished = false;
        double done = 0.0;
        double last_send_arrival = 0.0;
        double busy = 0.0;
        double grad_start = 0.0;  // start of the last gradient-producing action (B, split: W)
        double dur[4] = {0.0, 0.0, 0.0, 0.0};  // F, R, B, W without jitter (incl. overheads)
        double lat_act = 0.0, lat_grad = 0.0;  // outgoing fixed transfer times
        int stashed = 0, live = 0;
        int peak_stashed = 0, peak_live = 0, peak_inflight = 0;
        // inbound messages (arrival times, index = micro-batch) and how many were sent
        int acts_sent = 0, grads_sent = 0;
        int acts_seen = 0, grads_seen = 0;  // arrived by the last decision time
        // outbound links: free again at
        double act_link_free = 0.0, grad_link_free = 0.0;
        // inbound channels: when the last message on each landed (delivery stays in order)
        double last_act_arrival = 0.0, last_grad_arrival = 0.0;
        // time-shared slots: work left in the running action, and its current end
        double remaining = 0.0, expected_end = -1.0;
    };
    // When the input of action a (F: activation, B on a non-last stage: gradient) is ready
    // for rank k deciding at t; false (and k marked waiting) if the message is not sent yet.
    // Shared by both engines so that they wait by the same rule.
    bool input_ready_time(Rank& k, const Action& a, std::size_t row, double t, double& ready) const {
        const std::vector<double>* arr = nullptr;
        int sent = 0, kind = -1;
        if (a.kind == ActionKind::Forward && k.stage > 0) {
            arr = &act_arr_, sent = k.acts_sent, kind = 0;
        } else if (a.kind == ActionKind::Backward && k.stage < P_ - 1) {
            arr = &grad_arr_, sent = k.grads_sent, kind = 1;
        }
        ready = t;
        if (arr == nullptr) return true;
        if (a.mb >= sent) {
            k.waiting_kind = kind;
            k.waiting_mb = a.mb;
            return false;
        }
        ready = std::max(t, (*arr)[row + static_cast<std::size_t>(a.mb)]);
        return true;
    }
    // time-shared slots: the ranks running on a host, since when at which rate
    struct Host {
        std::vector<int> running;
        double since = 0.0, rate = 1.0;
    };
    void share_update(int h, double t);      // progress of the host's actions up to t
    void share_reschedule(int h, double t);  // new rate and end events from t

    void setup();
    void push(double t, Prio p, int r) {
        heap_.push(Event{t, (static_cast<std::uint64_t>(p) << 32) | static_cast<std::uint64_t>(r)});
    }
    // event engine
    void decide(int r, double t);
    void input_ready(int r, double ready, double now);
    void request_slot(int r, double t);
    void start_action(int r, double t);
    void end_action(int r, double t);
    // shared
    double begin_action(int r, double t);  // bookkeeping at start, returns the end time
    void complete_action(int r, double t);  // sends + bookkeeping at the end
    void send(int src, int dst, int kind, int mb, double t);
    void finish_rank(int r, double t);
    double half_normal(double sigma) { return sigma > 0.0 ? std::fabs(rng_.normal()) * sigma : 0.0; }
    // fast engine
    bool try_advance(int r);
    double next_arrival_lb(int u, int r, int depth, double t) const;
    void collect(PipelineRun& out);

    const SimConfig& c_;
    const int P_, m_, nrep_;
    Rng rng_;
    const bool steady_;
    bool slots_ = false;
    bool timeline_ = false;
    bool fast_ = false;
    int unfinished_ = 0;
    std::vector<Rank> ranks_;
    std::vector<StageScheduler> sched_;
    StageFlags rec_;  // per-stage recompute
    std::vector<double> act_arr_, grad_arr_;  // [rank * m + mb]
    std::vector<double> f_start_, b_start_;
    std::vector<int> f_count_;
    std::vector<int> free_slots_;
    std::vector<std::deque<int>> slot_queue_;
    bool share_ = false;
    std::vector<Host> hosts_;
    std::priority_queue<Event, std::vector<Event>, EvLater> heap_;
    long long actions_ = 0;
    std::vector<std::vector<Segment>> timeline_v_;
    std::vector<Transfer> transfers_;
};

void Engine::setup() {
    const int R = P_ * nrep_;
    const std::size_t M = static_cast<std::size_t>(m_);
    timeline_ = c_.record_timeline;
    slots_ = c_.compute_slots_per_host > 0;

    // schedulers: one prototype per stage, copied for replicas beyond the first
    rec_ = stage_flags(c_);
    auto proto = StageScheduler::for_pipeline(c_.policy, P_, m_, rec_, c_.split_backward, c_.max_in_flight);
    if (nrep_ == 1) {
        sched_ = std::move(proto);
    } else {
        sched_.reserve(static_cast<std::size_t>(R));
        for (int rep = 0; rep < nrep_; ++rep)
            for (int s = 0; s < P_; ++s) sched_.push_back(proto[static_cast<std::size_t>(s)]);
    }

    ranks_.assign(static_cast<std::size_t>(R), Rank{});
    const int rph = c_.ranks_per_host;
    int nhosts = 0;
    for (int r = 0; r < R; ++r) {
        auto& k = ranks_[static_cast<std::size_t>(r)];
        k.stage = r % P_;
        k.host = r / rph;
        nhosts = std::max(nhosts, k.host + 1);
    }
    for (int r = 0; r < R; ++r) {
        auto& k = ranks_[static_cast<std::size_t>(r)];
        const int s = k.stage;
        const auto us = static_cast<std::size_t>(s);
        const double scale = c_.rank_compute_scale.empty() ? 1.0 : c_.rank_compute_scale[static_cast<std::size_t>(r)];
        const double base[4] = {c_.fwd[us], c_.rec.empty() ? c_.fwd[us] : c_.rec[us], c_.bwd[us],
                                c_.split_backward ? c_.wgt[us] : 0.0};
        for (int a = 0; a < 4; ++a) k.dur[a] = base[a] * scale + c_.action_overhead;
        if (s < P_ - 1) k.dur[0] += c_.send_overhead;
        if (s > 0) k.dur[2] += c_.send_overhead;
        if (s < P_ - 1) {
            const double ab = c_.act_bytes.empty() ? 0.0 : c_.act_bytes[us];
            const bool local = ranks_[static_cast<std::size_t>(r + 1)].host == k.host;
            k.lat_act = local ? c_.local_alpha + ab / c_.local_beta : c_.p2p_alpha + ab / c_.p2p_beta;
        }
        if (s > 0) {
            const double ab = c_.act_bytes.empty() ? 0.0 : c_.act_bytes[us - 1];
            const double gb = c_.grad_bytes.empty() ? ab : c_.grad_bytes[us - 1];
            const bool local = ranks_[static_cast<std::size_t>(r - 1)].host == k.host;
            k.lat_grad = local ? c_.local_alpha + gb / c_.local_beta : c_.p2p_alpha + gb / c_.p2p_beta;
        }
    }
    unfinished_ = R;
    act_arr_.assign(static_cast<std::size_t>(R) * M, kInf);
    grad_arr_.assign(static_cast<std::size_t>(R) * M, kInf);
    if (steady_) {
        f_start_.assign(static_cast<std::size_t>(P_) * M, 0.0);
        b_start_.assign(static_cast<std::size_t>(P_) * M, 0.0);
        f_count_.assign(static_cast<std::size_t>(P_) * M, 0);
    }
    if (slots_) {
        free_slots_.assign(static_cast<std::size_t>(nhosts), c_.compute_slots_per_host);
        slot_queue_.assign(static_cast<std::size_t>(nhosts), {});
        share_ = c_.time_share_slots;
        if (share_) hosts_.assign(static_cast<std::size_t>(nhosts), Host{});
    }
    if (timeline_) timeline_v_.assign(static_cast<std::size_t>(R), {});
}

bool Engine::fast_applicable() const {
    if (c_.p2p_jitter_sigma > 0.0 || c_.compute_jitter_rel > 0.0) return false;
    if (c_.compute_slots_per_host > 0 && c_.compute_slots_per_host < c_.ranks_per_host) return false;
    for (const auto& k : ranks_) {
        if (k.stage < P_ - 1 && !(k.dur[0] + k.lat_act > 0.0)) return false;
        if (k.stage > 0 && !(k.dur[2] + k.lat_grad > 0.0)) return false;
    }
    return true;
}

void Engine::collect(PipelineRun& out) {
    const int R = P_ * nrep_;
    out.nrep = nrep_;
    out.m = m_;
    out.actions = actions_;
    out.done.resize(static_cast<std::size_t>(R));
    out.busy.resize(static_cast<std::size_t>(R));
    out.peak_stashed.resize(static_cast<std::size_t>(R));
    out.peak_live.resize(static_cast<std::size_t>(R));
    out.peak_inflight.resize(static_cast<std::size_t>(R));
    out.grad_start.resize(static_cast<std::size_t>(R));
    for (int r = 0; r < R; ++r) {
        const auto& k = ranks_[static_cast<std::size_t>(r)];
        if (!k.finished)
            throw std::logic_error("simulation ended with rank " + std::to_string(r) +
                                   " unfinished (schedule deadlock; internal error)");
        const auto ur = static_cast<std::size_t>(r);
        out.done[ur] = k.done;
        out.busy[ur] = k.busy;
        out.peak_stashed[ur] = k.peak_stashed;
        out.peak_live[ur] = k.peak_live;
        out.peak_inflight[ur] = k.peak_inflight;
        out.grad_start[ur] = k.grad_start;
    }
    out.f_start = std::move(f_start_);
    out.b_start = std::move(b_start_);
    out.f_count = std::move(f_count_);
    out.timeline = std::move(timeline_v_);
    // one canonical order for both engines
    std::sort(transfers_.begin(), transfers_.end(), [](const Transfer& a, const Transfer& b) {
        if (a.start != b.start) return a.start < b.start;
        if (a.src != b.src) return a.src < b.src;
        if (a.kind != b.kind) return a.kind < b.kind;
        return a.mb < b.mb;
    });
    out.transfers = std::move(transfers_);
}

// ------------------------------------------------------------------ event engine

PipelineRun Engine::run_events() {
    fast_ = false;
    const int R = P_ * nrep_;
    for (int r = 0; r < R; ++r) push(0.0, kDecide, r);
    while (!heap_.empty()) {
        const Event ev = heap_.top();
        heap_.pop();
        const int r = static_cast<int>(ev.key & 0xffffffffu);
        switch (static_cast<Prio>(ev.key >> 32)) {
            case kEnd: {
                if (share_) {  // a rescheduled action's earlier end events are stale
                    auto& k = ranks_[static_cast<std::size_t>(r)];
                    if (ev.t != k.expected_end) break;
                    k.expected_end = -1.0;
                }
                end_action(r, ev.t);
                // Decide right away unless another event at or before (t, decide, r) is
                // pending: ties must see every end / arrival at t first.
                const std::uint64_t dkey = (static_cast<std::uint64_t>(kDecide) << 32) | static_cast<std::uint64_t>(r);
                if (heap_.empty() || heap_.top().t > ev.t || (heap_.top().t == ev.t && heap_.top().key > dkey))
                    decide(r, ev.t);
                else
                    push(ev.t, kDecide, r);
                break;
            }
            case kReady: request_slot(r, ev.t); break;
            case kDecide: decide(r, ev.t); break;
        }
    }
    PipelineRun out;
    out.engine = 1;
    collect(out);
    return out;
}

void Engine::finish_rank(int r, double t) {
    auto& k = ranks_[static_cast<std::size_t>(r)];
    k.finished = true;
    k.done = std::max(t, k.last_send_arrival);
    --unfinished_;
}

void Engine::decide(int r, double t) {
    auto& k = ranks_[static_cast<std::size_t>(r)];
    const int s = k.stage;
    const std::size_t row = static_cast<std::size_t>(r) * static_cast<std::size_t>(m_);
    int acts = 0, grads = 0;
    if (s > 0) {
        while (k.acts_seen < k.acts_sent && act_arr_[row + static_cast<std::size_t>(k.acts_seen)] <= t) ++k.acts_seen;
        acts = k.acts_seen;
    }
    if (s < P_ - 1) {
        while (k.grads_seen < k.grads_sent && grad_arr_[row + static_cast<std::size_t>(k.grads_seen)] <= t)
            ++k.grads_seen;
        grads = k.grads_seen;
    }
    const auto a = sched_[static_cast<std::size_t>(r)].next(acts, grads);
    k.t_free = t;
    if (!a) {
        finish_rank(r, t);
        return;
    }
    k.cur = *a;
    double ready = t;
    if (!input_ready_time(k, *a, row, t, ready)) return;
    input_ready(r, ready, t);
}

void Engine::input_ready(int r, double ready, double now) {
    if (!slots_) {
        start_action(r, ready);
    } else if (ready > now) {
        push(ready, kReady, r);
    } else {
        request_slot(r, ready);
    }
}

void Engine::share_update(int h, double t) {
    auto& host = hosts_[static_cast<std::size_t>(h)];
    const double done = (t - host.since) * host.rate;
    for (int q : host.running) {
        auto& kq = ranks_[static_cast<std::size_t>(q)];
        kq.remaining = std::max(0.0, kq.remaining - done);
    }
    host.since = t;
}

void Engine::share_reschedule(int h, double t) {
    auto& host = hosts_[static_cast<std::size_t>(h)];
    const double n = static_cast<double>(host.running.size());
    host.rate = n > 0 ? std::min(1.0, c_.compute_slots_per_host / n) : 1.0;
    for (int q : host.running) {
        auto& kq = ranks_[static_cast<std::size_t>(q)];
        kq.expected_end = t + kq.remaining / host.rate;
        push(kq.expected_end, kEnd, q);
    }
}

void Engine::request_slot(int r, double t) {
    auto& k = ranks_[static_cast<std::size_t>(r)];
    const auto h = static_cast<std::size_t>(k.host);
    if (share_) {  // runs at once, sharing the host with its running actions
        share_update(k.host, t);
        k.remaining = begin_action(r, t) - t;
        hosts_[h].running.push_back(r);
        share_reschedule(k.host, t);
        return;
    }
    if (free_slots_[h] > 0) {
        --free_slots_[h];
        start_action(r, t);
    } else {
        k.wait_start = t;
        slot_queue_[h].push_back(r);
    }
}

void Engine::start_action(int r, double t) { push(begin_action(r, t), kEnd, r); }

void Engine::end_action(int r, double t) {
    if (share_) {
        const int h = ranks_[static_cast<std::size_t>(r)].host;
        share_update(h, t);
        auto& run = hosts_[static_cast<std::size_t>(h)].running;
        run.erase(std::find(run.begin(), run.end(), r));
        share_reschedule(h, t);
        if (timeline_) timeline_v_[static_cast<std::size_t>(r)].back().end = t;  // stretched
        complete_action(r, t);
        return;
    }
    complete_action(r, t);
    if (slots_) {
        const auto h = static_cast<std::size_t>(ranks_[static_cast<std::size_t>(r)].host);
        auto& q = slot_queue_[h];
        if (!q.empty()) {
            const int w = q.front();
            q.pop_front();
            if (timeline_)
                timeline_v_[static_cast<std::size_t>(w)].push_back(
                    Segment{SegmentKind::Wait, ranks_[static_cast<std::size_t>(w)].cur.mb,
                            ranks_[static_cast<std::size_t>(w)].wait_start, t});
            start_action(w, t);
        } else {
            ++free_slots_[h];
        }
    }
}

// ------------------------------------------------------------------ shared bookkeeping

double Engine::begin_action(int r, double t) {
    auto& k = ranks_[static_cast<std::size_t>(r)];
    const int s = k.stage;
    const Action a = k.cur;
    const int ak = static_cast<int>(a.kind);
    double dur = k.dur[ak];
    if (c_.compute_jitter_rel > 0.0) {
        const double base = dur - c_.action_overhead - ((ak == 0 && s < P_ - 1) || (ak == 2 && s > 0) ? c_.send_overhead : 0.0);
        dur += base * (std::max(0.0, 1.0 + c_.compute_jitter_rel * rng_.normal()) - 1.0);
    }
    k.busy += dur;
    ++actions_;
    if (a.kind == (c_.split_backward ? ActionKind::Weight : ActionKind::Backward)) k.grad_start = t;
    // memory states, counted from the start of the creating action
    switch (a.kind) {
        case ActionKind::Forward:
            if (rec_[static_cast<std::size_t>(s)] && s < P_ - 1) ++k.stashed;
            else ++k.live;
            break;
        case ActionKind::Recompute:
            --k.stashed;
            ++k.live;
            break;
        case ActionKind::Backward:
        case ActionKind::Weight: break;
    }
    k.peak_stashed = std::max(k.peak_stashed, k.stashed);
    k.peak_live = std::max(k.peak_live, k.live);
    k.peak_inflight = std::max(k.peak_inflight, k.stashed + k.live);
    const double end = t + dur;
    if (steady_ && r < P_) {
        const std::size_t idx = static_cast<std::size_t>(s) * static_cast<std::size_t>(m_) + static_cast<std::size_t>(a.mb);
        if (a.kind == ActionKind::Forward) {
            f_start_[idx] = t;
            f_count_[idx] = k.stashed + k.live;
        } else if (a.kind == ActionKind::Backward) {
            b_start_[idx] = t;
        }
    }
    if (timeline_)
        timeline_v_[static_cast<std::size_t>(r)].push_back(
            Segment{a.kind == ActionKind::Weight ? SegmentKind::Weight : static_cast<SegmentKind>(ak), a.mb, t, end});
    return end;
}

void Engine::complete_action(int r, double t) {
    auto& k = ranks_[static_cast<std::size_t>(r)];
    const int s = k.stage;
    const Action a = k.cur;
    if (a.kind == ActionKind::Forward && s < P_ - 1) send(r, r + 1, 0, a.mb, t);
    if (a.kind == ActionKind::Backward) {
        if (!c_.split_backward) --k.live;  // split: the graph lives until W
        if (s > 0) send(r, r - 1, 1, a.mb, t);
    }
    if (a.kind == ActionKind::Weight) --k.live;
}

void Engine::send(int src, int dst, int kind, int mb, double t) {
    auto& ks = ranks_[static_cast<std::size_t>(src)];
    auto& kd = ranks_[static_cast<std::size_t>(dst)];
    double& link_free = kind == 0 || c_.shared_egress ? ks.act_link_free : ks.grad_link_free;
    const double lat = kind == 0 ? ks.lat_act : ks.lat_grad;
    const double start = std::max(t, link_free);
    // the link carries the transfer (alpha + bytes/beta); jitter delays its delivery only, in order
    // on the channel (a message never lands before the one sent before it): without jitter the
    // arrival is start + lat, which is never before the previous arrival (start >= link_free)
    double& last = kind == 0 ? kd.last_act_arrival : kd.last_grad_arrival;
    const double arrival = std::max(start + lat + half_normal(c_.p2p_jitter_sigma), last);
    last = arrival;
    link_free = start + lat;
    ks.last_send_arrival = std::max(ks.last_send_arrival, arrival);
    int& sent = kind == 0 ? kd.acts_sent : kd.grads_sent;
    if (mb != sent)
        throw std::logic_error("micro-batch messages sent out of order (internal error): expected " +
                               std::to_string(sent) + ", got " + std::to_string(mb));
    const std::size_t idx = static_cast<std::size_t>(dst) * static_cast<std::size_t>(m_) + static_cast<std::size_t>(mb);
    (kind == 0 ? act_arr_ : grad_arr_)[idx] = arrival;
    ++sent;
    if (timeline_) transfers_.push_back(Transfer{kind, mb, src, dst, start, arrival});
    if (!fast_ && kd.waiting_kind == kind && kd.waiting_mb == mb) {
        kd.waiting_kind = -1;
        kd.waiting_mb = -1;
        input_ready(dst, std::max(arrival, kd.t_free), t);
    }
}

// ------------------------------------------------------------------ fast engine

// Lower bound on the arrival time of the next message rank u sends to its neighbour
// r (r = u+1: activation, r = u-1: gradient), from u's current state. Exact where it is <= t;
// clearly above t it may stop early at a partial bound that already exceeds t (the callers only ask
// "can a message arrive by t?", and the bound is non-decreasing in every term it maxes and adds,
// so a sender's partial bound above its own threshold decides its receiver's test the same way).
double Engine::next_arrival_lb(int u, int r, int depth, double t) const {
    const auto& k = ranks_[static_cast<std::size_t>(u)];
    const auto& kr = ranks_[static_cast<std::size_t>(r)];
    const bool down = r == u + 1;
    if (k.finished || (down ? kr.acts_sent : kr.grads_sent) >= m_) return kInf;
    const double dsend = down ? k.dur[0] : k.dur[2];
    const double lat = down ? k.lat_act : k.lat_grad;
    const double link = down || c_.shared_egress ? k.act_link_free : k.grad_link_free;
    double end_lb;
    if (k.waiting_kind < 0) {
        end_lb = k.t_free + dsend;
    } else {
        if (depth > P_) throw std::logic_error("circular wait between stages (internal error)");
        const bool act = k.waiting_kind == 0;
        const double dcur = k.dur[static_cast<int>(k.cur.kind)];
        const bool sends_to_r = down ? k.cur.kind == ActionKind::Forward : k.cur.kind == ActionKind::Backward;
        const double after = dcur + (sends_to_r ? 0.0 : dsend);  // from the awaited input to the send
        // without the awaited input's arrival: already above t (by a margin far above rounding, so
        // that the receivers' sums with it stay above their thresholds), so the test is decided
        const double partial = std::max(k.t_free + after, link) + lat;
        if (partial > t + 1e-9 * std::max(1.0, std::abs(t))) return partial;
        // the awaited input: its arrival if already sent, else a bound from its sender
        double in;
        if (k.waiting_mb < (act ? k.acts_sent : k.grads_sent)) {
            in = (act ? act_arr_ : grad_arr_)[static_cast<std::size_t>(u) * static_cast<std::size_t>(m_) +
                                              static_cast<std::size_t>(k.waiting_mb)];
        } else {
            in = next_arrival_lb(act ? u - 1 : u + 1, u, depth + 1, t - after - lat);
        }
        end_lb = std::max(k.t_free, in) + after;
    }
    return std::max(end_lb, link) + lat;
}

bool Engine::try_advance(int r) {
    auto& k = ranks_[static_cast<std::size_t>(r)];
    const int s = k.stage;
    const std::size_t row = static_cast<std::size_t>(r) * static_cast<std::size_t>(m_);
    auto& sched = sched_[static_cast<std::size_t>(r)];
    bool progressed = false;
    for (;;) {
        if (k.finished) return progressed;
        if (k.waiting_kind >= 0) {
            const bool act = k.waiting_kind == 0;
            if (k.waiting_mb >= (act ? k.acts_sent : k.grads_sent)) return progressed;
            const double arr = (act ? act_arr_ : grad_arr_)[row + static_cast<std::size_t>(k.waiting_mb)];
            k.waiting_kind = -1;
            k.waiting_mb = -1;
            const double end = begin_action(r, std::max(k.t_free, arr));
            complete_action(r, end);
            k.t_free = end;
            progressed = true;
            continue;
        }
        const double t = k.t_free;
        int acts = 0, grads = 0;
        if (s > 0) {
            while (k.acts_seen < k.acts_sent && act_arr_[row + static_cast<std::size_t>(k.acts_seen)] <= t)
                ++k.acts_seen;
            if (!(k.acts_seen < k.acts_sent || k.acts_sent >= m_ || next_arrival_lb(r - 1, r, 0, t) > t))
                return progressed;
            acts = k.acts_seen;
        }
        if (s < P_ - 1) {
            while (k.grads_seen < k.grads_sent && grad_arr_[row + static_cast<std::size_t>(k.grads_seen)] <= t)
                ++k.grads_seen;
            if (!(k.grads_seen < k.grads_sent || k.grads_sent >= m_ || next_arrival_lb(r + 1, r, 0, t) > t))
                return progressed;
            grads = k.grads_seen;
        }
        const auto a = sched.next(acts, grads);
        progressed = true;
        if (!a) {
            finish_rank(r, t);
            return true;
        }
        k.cur = *a;
        double ready = t;
        if (!input_ready_time(k, *a, row, t, ready)) continue;
        const double end = begin_action(r, ready);
        complete_action(r, end);
        k.t_free = end;
    }
}

bool Engine::run_fast(PipelineRun& out) {
    fast_ = true;
    const int R = P_ * nrep_;
    bool forward = true;
    while (unfinished_ > 0) {
        bool any = false;
        if (forward) {
            for (int r = 0; r < R; ++r) any = try_advance(r) || any;
        } else {
            for (int r = R - 1; r >= 0; --r) any = try_advance(r) || any;
        }
        if (!any) return false;
        forward = !forward;
    }
    out.engine = 2;
    collect(out);
    return true;
}

// ---------------------------------------------------------------------------------

double mean_exact(const std::vector<double>& v, int s, int P, int nrep) {
    // Mean over replicas of v[rep * P + s]; identical values give that value exactly
    // (so the one-replica shortcut is bit-identical to the full simulation).
    const double first = v[static_cast<std::size_t>(s)];
    bool same = true;
    double sum = 0.0;
    for (int rep = 0; rep < nrep; ++rep) {
        const double x = v[static_cast<std::size_t>(rep * P + s)];
        same = same && x == first;
        sum += x;
    }
    return same ? first : sum / nrep;
}

}  // namespace

double dp_allreduce_end(double bytes, int D, double done, double grad_start, const SimConfig& c) {
    const double whole = allreduce_time(bytes, D, c.ar_alpha, c.ar_beta);
    if (!(c.bucket_bytes > 0.0) || bytes <= c.bucket_bytes) return done + whole;
    const double n = std::ceil(bytes / c.bucket_bytes);
    const double last = bytes - (n - 1.0) * c.bucket_bytes;
    return std::max(done + allreduce_time(last, D, c.ar_alpha, c.ar_beta), grad_start + whole);
}

namespace {

// Sync phase + per-stage statistics.
SimResult finish(const SimConfig& c, PipelineRun&& run) {
    const int P = c.P, D = c.D, nrep = run.nrep;
    const int R = P * nrep;
    SimResult res;
    res.replicas_simulated = nrep;
    res.m_simulated[0] = run.m;
    res.events = run.actions;
    res.engine_used = run.engine;

    std::vector<double> cur = run.done;
    res.pipeline_time = 0.0;
    for (double d : run.done) res.pipeline_time = std::max(res.pipeline_time, d);
    const bool tl = c.record_timeline;
    if (tl) res.timeline = std::move(run.timeline);
    auto seg = [&](int r, SegmentKind k, int mb, double a, double b) {
        if (tl && b > a) res.timeline[static_cast<std::size_t>(r)].push_back(Segment{k, mb, a, b});
    };

    // data-parallel all-reduce per stage, in buckets launched during the last backward
    for (int s = 0; s < P; ++s) {
        double done = 0.0, gstart = 0.0;
        for (int rep = 0; rep < nrep; ++rep) {
            const auto ur = static_cast<std::size_t>(rep * P + s);
            done = std::max(done, cur[ur]);
            gstart = std::max(gstart, run.grad_start.empty() ? cur[ur] : run.grad_start[ur]);
        }
        const double bytes = c.dp_bytes.empty() ? 0.0 : c.dp_bytes[static_cast<std::size_t>(s)];
        const double end = dp_allreduce_end(bytes, D, done, gstart, c);
        for (int rep = 0; rep < nrep; ++rep) {
            seg(rep * P + s, SegmentKind::AllReduce, -1, done, end);
            cur[static_cast<std::size_t>(rep * P + s)] = std::max(done, end);
        }
    }
    // tied-weight groups: each starts when its member ranks are done (beside the DP all-reduce)
    for (std::size_t g = 0; g < c.tied.size(); ++g) {
        const auto& grp = c.tied[g];
        double start = 0.0;
        for (int rep = 0; rep < nrep; ++rep)
            for (int s : grp.stages) start = std::max(start, run.done[static_cast<std::size_t>(rep * P + s)]);
        const int n = static_cast<int>(grp.stages.size()) * D;
        const double end = start + allreduce_time(grp.bytes, n, c.ar_alpha, c.ar_beta);
        for (int rep = 0; rep < nrep; ++rep)
            for (int s : grp.stages) {
                seg(rep * P + s, SegmentKind::Tied, static_cast<int>(g), start, end);
                auto& x = cur[static_cast<std::size_t>(rep * P + s)];
                x = std::max(x, end);
            }
    }
    // consensus, then optimizer
    double cstart = 0.0;
    for (double x : cur) cstart = std::max(cstart, x);
    const double cend = cstart + (static_cast<long long>(P) * D > 1 ? c.consensus_latency : 0.0);
    res.minibatch_time = cend;
    for (int r = 0; r < R; ++r) {
        const int s = r % P;
        seg(r, SegmentKind::Consensus, -1, cstart, cend);
        const double opt = c.opt.empty() ? 0.0 : c.opt[static_cast<std::size_t>(s)];
        seg(r, SegmentKind::Optimizer, -1, cend, cend + opt);
        res.minibatch_time = std::max(res.minibatch_time, cend + opt);
    }

    res.stage_busy.resize(static_cast<std::size_t>(P));
    res.stage_bubble.resize(static_cast<std::size_t>(P));
    res.stage_done.assign(static_cast<std::size_t>(P), 0.0);
    res.peak_stashed.assign(static_cast<std::size_t>(P), 0);
    res.peak_live.assign(static_cast<std::size_t>(P), 0);
    res.peak_inflight.assign(static_cast<std::size_t>(P), 0);
    for (int s = 0; s < P; ++s) {
        const auto us = static_cast<std::size_t>(s);
        res.stage_busy[us] = mean_exact(run.busy, s, P, nrep);
        for (int rep = 0; rep < nrep; ++rep) {
            const auto ur = static_cast<std::size_t>(rep * P + s);
            res.stage_done[us] = std::max(res.stage_done[us], run.done[ur]);
            res.peak_stashed[us] = std::max(res.peak_stashed[us], run.peak_stashed[ur]);
            res.peak_live[us] = std::max(res.peak_live[us], run.peak_live[ur]);
            res.peak_inflight[us] = std::max(res.peak_inflight[us], run.peak_inflight[ur]);
        }
    }
    double bsum = 0.0;
    for (int s = 0; s < P; ++s) {
        const auto us = static_cast<std::size_t>(s);
        res.stage_bubble[us] = res.pipeline_time > 0.0 ? 1.0 - res.stage_busy[us] / res.pipeline_time : 0.0;
        bsum += res.stage_bubble[us];
    }
    res.bubble_fraction = bsum / P;
    if (tl) res.transfers = std::move(run.transfers);
    return res;
}

bool has_jitter(const SimConfig& c) { return c.p2p_jitter_sigma > 0.0 || c.compute_jitter_rel > 0.0; }

bool replicas_identical(const SimConfig& c) {
    if (c.D == 1) return true;
    if (has_jitter(c)) return false;
    for (double x : c.rank_compute_scale)
        if (x != c.rank_compute_scale[0]) return false;
    // every host holds ranks of one replica only, and every replica sees the same
    // host boundaries (link locality, slot sharing)
    return c.P % c.ranks_per_host == 0;
}

PipelineRun run_pipeline(const SimConfig& c, int m, bool steady = false) {
    const int nrep = (c.replica_shortcut && replicas_identical(c)) ? 1 : c.D;
    if (c.engine != 1) {
        Engine e(c, m, nrep, steady);
        if (e.fast_applicable()) {
            PipelineRun out;
            if (e.run_fast(out)) return out;
        } else if (c.engine == 2) {
            throw std::invalid_argument(
                "engine='fast' needs no jitter, no compute-slot contention and a positive lookahead "
                "(every sending action or link takes > 0 s); use engine='auto'");
        }
    }
    Engine e(c, m, nrep, steady);
    return e.run_events();
}

SimResult simulate_exact(const SimConfig& c, int m) { return finish(c, run_pipeline(c, m)); }

struct Steady {
    int c = 0;            // period in micro-batches, 0 = none found
    int f0 = 0;           // start of the periodic part of the F windows (all stages)
    bool single = false;  // one steady state: every sequence advances by d per period at the
    double d = 0.0;       //   same time (then T(m + c) = T(m) + d)
};

// Where to look for the steady state, in micro-batch indices: F starts after the
// warm-up (Varuna runs ~4P forwards ahead on stage 0, 1F1B P-1), B starts after the
// pipeline fill and before the drain.  min_period() then adapts the ends.
struct Windows {
    int f0, f1, b0, b1;
};
Windows windows(Policy policy, int P, int m) {
    const int k = policy == Policy::Varuna ? kVarunaSkip : 1;
    return Windows{k * P + kWindowSlack, m - kWindowSlack, P + kWindowSlack, m - P - kWindowSlack};
}

// Smallest period p <= pmax of y on a stretch of [i0, i1): y[i + p] - y[i] is the same
// (absolute tolerance tol) for every i of a stretch of at least max(3p, kMinRun)
// micro-batches that ends at i1 (suffix = true: forwards may take longer than the
// nominal warm-up to settle) or starts at i0 (backwards may start draining earlier).
// 0 if none; *lo, *hi receive the stretch.
int min_period(const double* y, int i0, int i1, int pmax, double tol, bool suffix, int* lo, int* hi) {
    for (int p = 1; p <= pmax && 2 * p <= i1 - i0; ++p) {
        int j, k;
        if (suffix) {
            const double d0 = y[i1 - 1] - y[i1 - 1 - p];
            j = i1 - 1 - p;  // periodic on [j, i1)
            while (j > i0 && std::fabs(y[j - 1 + p] - y[j - 1] - d0) <= tol) --j;
            k = i1;
        } else {
            const double d0 = y[i0 + p] - y[i0];
            k = i0 + p + 1;  // periodic on [i0, k)
            while (k < i1 && std::fabs(y[k] - y[k - p] - d0) <= tol) ++k;
            j = i0;
        }
        if (k - j >= std::max(3 * p, kMinRun)) {
            *lo = j;
            *hi = k;
            return p;
        }
    }
    return 0;
}

// The pipeline state repeats every c micro-batches when, on every stage, the start
// times of F(i) (on a stretch ending at the F window's end) and of B(i) (on a stretch
// starting at the B window's start) do: c is the lcm of the sequences' minimal
// periods (at most kMaxPeriod).  One steady state: every sequence advances by the same
// d per period, the F and B stretches of every stage overlap in time, and the policy
// interleaves forwards and backwards (not GPipe, whose phases follow each other).
Steady detect_steady(const PipelineRun& run, Policy policy, int P) {
    Steady st;
    const int m = run.m;
    const Windows w = windows(policy, P, m);
    const int pmax = std::min(kMaxPeriod, std::min(w.f1 - w.f0, w.b1 - w.b0) / 2);
    if (pmax < 1) return st;
    double scale = 0.0;
    for (double x : run.b_start) scale = std::max(scale, std::fabs(x));
    const double tol = 1e-9 * std::max(scale, 1e-30);
    const std::size_t M = static_cast<std::size_t>(m);
    const bool interleaved = policy != Policy::GPipe;
    long long c = 1;
    int f0max = w.f0;
    bool overlap = true;
    for (int s = 0; s < P; ++s) {
        const std::size_t row = static_cast<std::size_t>(s) * M;
        const double* F = run.f_start.data() + row;
        const double* B = run.b_start.data() + row;
        int flo = 0, fhi = 0, blo = 0, bhi = 0;
        const int pf = min_period(F, w.f0, w.f1, pmax, tol, true, &flo, &fhi);
        if (pf == 0) return st;
        const int pb = min_period(B, w.b0, w.b1, pmax, tol, false, &blo, &bhi);
        if (pb == 0) return st;
        c = c / std::gcd(c, static_cast<long long>(pf)) * pf;
        c = c / std::gcd(c, static_cast<long long>(pb)) * pb;
        if (c > pmax) return st;
        // steady at the same time?  If not (Varuna whose stage 0 ran all its forwards
        // ahead, like GPipe's two phases) the state is not one steady state
        if (std::min(F[fhi - 1], B[bhi - 1]) - std::max(F[flo], B[blo]) <= 0.0) overlap = false;
        f0max = std::max(f0max, flo);
    }
    st.c = static_cast<int>(c);
    st.f0 = f0max;
    const double d = run.b_start[static_cast<std::size_t>(w.b0 + st.c)] - run.b_start[static_cast<std::size_t>(w.b0)];
    bool same = d > 0.0 && interleaved && overlap;
    for (int s = 0; same && s < P; ++s) {
        const std::size_t row = static_cast<std::size_t>(s) * M;
        const double* F = run.f_start.data() + row;
        const double* B = run.b_start.data() + row;
        same = st.f0 + st.c < w.f1 && std::fabs(F[w.f1 - 1] - F[w.f1 - 1 - st.c] - d) <= tol &&
               std::fabs(B[w.b0 + st.c] - B[w.b0] - d) <= tol;
    }
    st.single = same;
    st.d = d;
    return st;
}

int clamp_peak(double v, int lo, int m) {
    const double r = std::round(v);
    return static_cast<int>(std::min<double>(std::max<double>(r, lo), m));
}

// Extrapolation to m (see simulator.h).  Returns false when m is too small to gain
// anything (the caller then simulates m exactly).
bool extrapolate(const SimConfig& c, SimResult& out) {
    const int P = c.P, m = c.m;
    const int skip = c.policy == Policy::Varuna ? kVarunaSkip : 1;
    const int cap = c.extrapolate_cap > 0 ? c.extrapolate_cap : (skip + 1) * P + kCapAdd;
    if (static_cast<long long>(m) < static_cast<long long>(cap) + P + 2LL * kAlign) return false;
    // run A; without a steady state (long transients: nearly balanced stages lock to the
    // bottleneck slowly) retry once with a run twice as long, then give up
    int mA = 0;
    PipelineRun A;
    Steady st;
    long long actions = 0;
    long long spent = 0;  // micro-batches simulated so far
    for (int len = cap;; len *= 2) {
        // worth it only if the runs stay well below m: one run suffices for one steady
        // state (1F1B, Varuna), GPipe's two phases need two
        const long long runs = c.policy == Policy::GPipe ? 2 : 1;
        const long long need = spent + runs * (len + kAlign);
        if (len == cap ? 5 * need > 4LL * m : 2 * need > m) return false;  // retry only when cheap
        mA = len + (m - len) % kAlign;  // common periods divide kAlign: usually no extra run
        spent += mA;
        A = run_pipeline(c, mA, true);
        actions += A.actions;
        st = detect_steady(A, c.policy, P);
        if (st.c > 0 || len != cap) break;
    }
    if (st.c == 0) return false;

    // The two points: T(m) = T(m1) + (m - m1) * slope.
    //  one steady state:       m1 = m (mod c), slope = d / c          (one or two runs)
    //  period with several rates (GPipe: forward phase, then backward phase):
    //                           m1 = m (mod c), m2 = m1 + c, secant  (two or three runs)
    int m1 = mA + (m - mA) % st.c, m2 = st.single ? 0 : m1 + st.c;
    if (std::max(m1, m2) >= m) return false;
    PipelineRun R1;
    if (m1 == mA) {
        R1 = std::move(A);
    } else {
        R1 = run_pipeline(c, m1, true);
        actions += R1.actions;
    }
    PipelineRun R2;
    if (m2 > 0) {
        R2 = run_pipeline(c, m2, true);
        actions += R2.actions;
        // Several rates outside GPipe (Varuna whose stage 0 ran far ahead, or stages still
        // drifting slowly towards the bottleneck, which can look periodic for a while):
        // confirm the slope at about twice the length, else simulate m exactly.
        if (c.policy != Policy::GPipe) {
            const int m3 = m2 + st.c * ((m1 + st.c - 1) / st.c);
            if (5LL * (spent + (m1 == mA ? 0 : m1) + m2 + m3) > 4LL * m) return false;
            const PipelineRun R3 = run_pipeline(c, m3, false);
            actions += R3.actions;
            const double t1 = finish(c, PipelineRun(R1)).minibatch_time;
            const double t2 = finish(c, PipelineRun(R2)).minibatch_time;
            const double t3 = finish(c, PipelineRun(R3)).minibatch_time;
            if (std::fabs(t3 - t1 - (t2 - t1) * (m3 - m1) / st.c) > 1e-9 * t3) return false;
        }
    }
    const int mp = m2 > 0 ? m2 : m1;  // run whose in-flight counts measure peak growth
    const std::vector<int> fcount = m2 > 0 ? R2.f_count : R1.f_count;
    SimResult r1 = finish(c, std::move(R1));
    SimResult r2 = m2 > 0 ? finish(c, std::move(R2)) : SimResult{};
    const double dm = static_cast<double>(m - m1);
    auto ex = [&](double x1, double x2) {
        return st.single ? x1 + dm * (st.d / st.c) : x1 + dm * (x2 - x1) / static_cast<double>(m2 - m1);
    };
    SimResult r = std::move(r1);
    r.minibatch_time = ex(r.minibatch_time, r2.minibatch_time);
    r.pipeline_time = ex(r.pipeline_time, r2.pipeline_time);
    const Windows w = windows(c.policy, P, mp);
    const StageFlags flags = stage_flags(c);
    double bsum = 0.0;
    for (int s = 0; s < P; ++s) {
        const auto us = static_cast<std::size_t>(s);
        // without jitter every micro-batch costs the same on a stage: busy is exactly linear
        r.stage_busy[us] = r.stage_busy[us] / m1 * m;
        r.stage_done[us] = ex(r.stage_done[us], m2 > 0 ? r2.stage_done[us] : 0.0);
        r.stage_bubble[us] = r.pipeline_time > 0.0 ? 1.0 - r.stage_busy[us] / r.pipeline_time : 0.0;
        bsum += r.stage_bubble[us];
        // Peaks: the in-flight count at F starts grows by g per micro-batch over whole
        // periods of the F window (0 in a bounded steady state, 1 for GPipe); the state
        // F creates (stashed input with recompute, else the live graph) takes the growth.
        double g = 0.0;
        const int f0 = std::max(st.f0, w.f0);
        const int j = (w.f1 - 1 - f0) / st.c;
        const std::size_t row = us * static_cast<std::size_t>(mp);
        if (j > 0)
            g = static_cast<double>(fcount[row + static_cast<std::size_t>(f0 + j * st.c)] -
                                    fcount[row + static_cast<std::size_t>(f0)]) /
                (static_cast<double>(j) * st.c);
        const int base_inflight = std::max(r.peak_inflight[us], m2 > 0 ? r2.peak_inflight[us] : 0);
        const int base_stashed = std::max(r.peak_stashed[us], m2 > 0 ? r2.peak_stashed[us] : 0);
        const int base_live = std::max(r.peak_live[us], m2 > 0 ? r2.peak_live[us] : 0);
        const double grow = std::max(g, 0.0) * static_cast<double>(m - mp);
        const bool stash_grows = flags[us] && s < P - 1;
        r.peak_inflight[us] = clamp_peak(base_inflight + grow, base_inflight, m);
        r.peak_stashed[us] = stash_grows ? clamp_peak(base_stashed + grow, base_stashed, m) : base_stashed;
        r.peak_live[us] = stash_grows ? base_live : clamp_peak(base_live + grow, base_live, m);
    }
    r.bubble_fraction = bsum / P;
    r.extrapolated = true;
    r.m_simulated[0] = m1;
    r.m_simulated[1] = m2;
    r.period = st.c;
    r.events = actions;
    out = std::move(r);
    return true;
}

}  // namespace

// ---------------------------------------------------------------------------------

double allreduce_time(double bytes, int n, double ar_alpha, double ar_beta) {
    if (n <= 1 || bytes <= 0.0) return 0.0;
    const double k = 2.0 * (n - 1);
    return ar_alpha * k + k / n * bytes / ar_beta;
}

StageFlags stage_flags(const SimConfig& c) {
    return c.stage_recompute.empty() ? uniform_flags(c.P, c.recompute) : c.stage_recompute;
}

void validate(const SimConfig& c) {
    validate_shape(c.P, c.m);
    if (!c.stage_recompute.empty()) validate_flags(c.P, c.stage_recompute);
    if (!c.max_in_flight.empty()) {
        if (c.max_in_flight.size() != static_cast<std::size_t>(c.P))
            bad("max_in_flight must have one cap per stage (P=" + std::to_string(c.P) + ", 0 = none) or be empty, got " +
                std::to_string(c.max_in_flight.size()));
        for (int cap : c.max_in_flight) validate_cap(c.policy, cap);
    }
    if (c.D < 1) bad("D (number of data-parallel replicas) must be >= 1, got " + std::to_string(c.D));
    const auto P = static_cast<std::size_t>(c.P);
    check_vec(c.fwd, "fwd", P, false, "seconds per micro-batch, one per stage", "seconds");
    check_vec(c.bwd, "bwd", P, false, "seconds per micro-batch, one per stage", "seconds");
    check_vec(c.rec, "rec", P, true, "seconds per micro-batch, one per stage", "seconds");
    check_vec(c.opt, "opt", P, true, "optimizer step seconds, one per stage", "seconds");
    validate_split(c.policy, c.split_backward);
    if (c.split_backward)
        check_vec(c.wgt, "wgt", P, false, "weight-gradient (W) seconds per micro-batch, one per stage, with "
                  "split_backward", "seconds");
    else if (!c.wgt.empty())
        bad("wgt (weight-gradient seconds) is only used with split_backward=true; leave it empty or set "
            "split_backward");
    if (c.P > 1) {
        check_vec(c.act_bytes, "act_bytes", P - 1, true, "bytes per micro-batch sent s -> s+1; P-1 boundaries, "
                  "or P with the last ignored", "bytes", P);
        check_vec(c.grad_bytes, "grad_bytes", P - 1, true, "bytes per micro-batch sent s+1 -> s; P-1 boundaries, "
                  "or P with the last ignored", "bytes", P);
    } else {
        check_vec(c.act_bytes, "act_bytes", 1, true, "P=1 has no boundary", "bytes");
        check_vec(c.grad_bytes, "grad_bytes", 1, true, "P=1 has no boundary", "bytes");
    }
    check_vec(c.dp_bytes, "dp_bytes", P, true, "gradient bytes all-reduced per stage", "bytes");
    for (std::size_t g = 0; g < c.tied.size(); ++g) {
        const auto& grp = c.tied[g];
        const std::string name = "tied[" + std::to_string(g) + "]";
        if (grp.stages.empty()) bad(name + ".stages must list at least one stage");
        std::vector<char> seen(P, 0);
        for (int s : grp.stages) {
            if (s < 0 || s >= c.P)
                bad(name + ".stages: stage " + std::to_string(s) + " is out of range 0.." + std::to_string(c.P - 1));
            if (seen[static_cast<std::size_t>(s)]) bad(name + ".stages: stage " + std::to_string(s) + " listed twice");
            seen[static_cast<std::size_t>(s)] = 1;
        }
        check_nonneg(grp.bytes, name + ".bytes", "bytes");
    }
    check_nonneg(c.p2p_alpha, "p2p_alpha", "seconds");
    check_nonneg(c.local_alpha, "local_alpha", "seconds");
    check_nonneg(c.ar_alpha, "ar_alpha", "seconds");
    check_nonneg(c.consensus_latency, "consensus_latency", "seconds");
    check_nonneg(c.bucket_bytes, "bucket_bytes", "bytes");
    check_beta(c.p2p_beta, "p2p_beta");
    check_beta(c.local_beta, "local_beta");
    check_beta(c.ar_beta, "ar_beta");
    if (c.ranks_per_host < 1) bad("ranks_per_host must be >= 1, got " + std::to_string(c.ranks_per_host));
    if (c.compute_slots_per_host < 0)
        bad("compute_slots_per_host must be >= 0 (0 = unlimited), got " + std::to_string(c.compute_slots_per_host));
    check_nonneg(c.action_overhead, "action_overhead", "seconds");
    check_nonneg(c.send_overhead, "send_overhead", "seconds");
    check_nonneg(c.p2p_jitter_sigma, "p2p_jitter_sigma", "seconds");
    check_nonneg(c.compute_jitter_rel, "compute_jitter_rel", "(relative)");
    if (!c.rank_compute_scale.empty()) {
        const auto want = static_cast<std::size_t>(c.P) * static_cast<std::size_t>(c.D);
        if (c.rank_compute_scale.size() != want)
            bad("rank_compute_scale must have P*D = " + std::to_string(want) +
                " entries (one per rank, rank = replica*P + stage) or be empty, got " +
                std::to_string(c.rank_compute_scale.size()));
        for (std::size_t i = 0; i < want; ++i)
            if (!(c.rank_compute_scale[i] > 0.0) || !std::isfinite(c.rank_compute_scale[i]))
                bad("rank_compute_scale[" + std::to_string(i) + "] must be a finite number > 0, got " +
                    num(c.rank_compute_scale[i]));
    }
    if (!(std::isfinite(c.data_read) && c.data_read >= 0.0))
        bad("data_read (seconds per rank to read a mini-batch's data) must be a finite number >= 0, got " +
            num(c.data_read));
    if (c.extrapolate_cap < 0)
        bad("extrapolate_cap must be >= 0 (0 = max(4P, 16)), got " + std::to_string(c.extrapolate_cap));
}

double with_data_read(double t, double read, bool prefetch) { return prefetch ? std::max(t, read) : t + read; }

namespace {
SimResult simulate_compute(const SimConfig& c) {
    if (c.extrapolate && !has_jitter(c) && !c.record_timeline) {
        SimResult r;
        if (extrapolate(c, r)) return r;
    }
    return simulate_exact(c, c.m);
}
}  // namespace

SimResult simulate(const SimConfig& c) {
    validate(c);
    SimResult r = simulate_compute(c);
    const double t = with_data_read(r.minibatch_time, c.data_read, c.data_prefetch);
    r.data_wait = t - r.minibatch_time;
    r.minibatch_time = t;
    return r;
}

}  // namespace varuna
