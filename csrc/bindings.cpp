// The single pybind11 translation unit: module varuna_sdk._core.
//
// Keep every pybind11 include in this file (each TU that includes pybind11 costs
// ~12 s to compile).  The C++ logic lives in plain C++17 files such as schedule.cpp.
// std::invalid_argument thrown by the C++ side surfaces in Python as ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "schedule.h"
#include "search.h"
#include "simulator.h"

namespace py = pybind11;

namespace {

using ActionTuple = std::tuple<int, int>;  // (kind: 0=F 1=R 2=B 3=W, micro-batch)

ActionTuple to_tuple(const varuna::Action& a) { return {static_cast<int>(a.kind), a.mb}; }

std::vector<ActionTuple> to_tuples(const std::vector<varuna::Action>& v) {
    std::vector<ActionTuple> out;
    out.reserve(v.size());
    for (const auto& a : v) out.push_back(to_tuple(a));
    return out;
}

// recompute from Python: None (the policy's default), one bool for every stage, or a list of P
// bools (one per stage; the C++ side checks the length).
using RecomputeArg = std::optional<std::variant<bool, std::vector<bool>>>;

varuna::StageFlags resolve_flags(varuna::Policy p, int P, const RecomputeArg& recompute) {
    varuna::validate_shape(P, 1);
    if (!recompute.has_value()) return varuna::uniform_flags(P, varuna::default_recompute(p));
    if (const bool* b = std::get_if<bool>(&*recompute)) return varuna::uniform_flags(P, *b);
    return std::get<std::vector<bool>>(*recompute);
}

// --- simulator helpers ----------------------------------------------------------
using TiedTuple = std::tuple<std::vector<int>, double>;              // (stages, bytes)
using SegmentTuple = std::tuple<int, int, double, double>;           // (kind, mb, start, end)
using TransferTuple = std::tuple<int, int, int, int, double, double>;  // (kind, mb, src, dst, start, end)

void bind_simulator(py::module_& m) {
    using varuna::SimConfig;
    using varuna::SimResult;
    py::class_<SimConfig>(m, "SimConfig",
                          "Input of simulate(); fields as in csrc/simulator.h (seconds, bytes, bytes/s). "
                          "Use varuna_sdk.planner.simulate instead.")
        .def(py::init<>())
        .def_readwrite("P", &SimConfig::P)
        .def_readwrite("D", &SimConfig::D)
        .def_readwrite("m", &SimConfig::m)
        .def_property(
            "policy", [](const SimConfig& c) { return std::string(varuna::policy_name(c.policy)); },
            [](SimConfig& c, const std::string& p) { c.policy = varuna::parse_policy(p); })
        .def_readwrite("recompute", &SimConfig::recompute)
        .def_readwrite("stage_recompute", &SimConfig::stage_recompute)
        .def_readwrite("max_in_flight", &SimConfig::max_in_flight)
        .def_readwrite("shared_egress", &SimConfig::shared_egress)
        .def_readwrite("data_read", &SimConfig::data_read)
        .def_readwrite("data_prefetch", &SimConfig::data_prefetch)
        .def_readwrite("fwd", &SimConfig::fwd)
        .def_readwrite("bwd", &SimConfig::bwd)
        .def_readwrite("rec", &SimConfig::rec)
        .def_readwrite("wgt", &SimConfig::wgt)
        .def_readwrite("bucket_bytes", &SimConfig::bucket_bytes)
        .def_readwrite("split_backward", &SimConfig::split_backward)
        .def_readwrite("opt", &SimConfig::opt)
        .def_readwrite("act_bytes", &SimConfig::act_bytes)
        .def_readwrite("grad_bytes", &SimConfig::grad_bytes)
        .def_readwrite("dp_bytes", &SimConfig::dp_bytes)
        .def_property(
            "tied",
            [](const SimConfig& c) {
                std::vector<TiedTuple> out;
                for (const auto& g : c.tied) out.emplace_back(g.stages, g.bytes);
                return out;
            },
            [](SimConfig& c, const std::vector<TiedTuple>& v) {
                c.tied.clear();
                for (const auto& t : v) c.tied.push_back(varuna::TiedGroup{std::get<0>(t), std::get<1>(t)});
            },
            "list of (stages, bytes)")
        .def_readwrite("p2p_alpha", &SimConfig::p2p_alpha)
        .def_readwrite("p2p_beta", &SimConfig::p2p_beta)
        .def_readwrite("local_alpha", &SimConfig::local_alpha)
        .def_readwrite("local_beta", &SimConfig::local_beta)
        .def_readwrite("ar_alpha", &SimConfig::ar_alpha)
        .def_readwrite("ar_beta", &SimConfig::ar_beta)
        .def_readwrite("consensus_latency", &SimConfig::consensus_latency)
        .def_readwrite("ranks_per_host", &SimConfig::ranks_per_host)
        .def_readwrite("compute_slots_per_host", &SimConfig::compute_slots_per_host)
        .def_readwrite("time_share_slots", &SimConfig::time_share_slots)
        .def_readwrite("action_overhead", &SimConfig::action_overhead)
        .def_readwrite("send_overhead", &SimConfig::send_overhead)
        .def_readwrite("p2p_jitter_sigma", &SimConfig::p2p_jitter_sigma)
        .def_readwrite("compute_jitter_rel", &SimConfig::compute_jitter_rel)
        .def_readwrite("seed", &SimConfig::seed)
        .def_readwrite("rank_compute_scale", &SimConfig::rank_compute_scale)
        .def_readwrite("record_timeline", &SimConfig::record_timeline)
        .def_readwrite("extrapolate", &SimConfig::extrapolate)
        .def_readwrite("extrapolate_cap", &SimConfig::extrapolate_cap)
        .def_readwrite("replica_shortcut", &SimConfig::replica_shortcut)
        .def_property(
            "engine",
            [](const SimConfig& c) { return std::string(c.engine == 1 ? "event" : c.engine == 2 ? "fast" : "auto"); },
            [](SimConfig& c, const std::string& e) {
                if (e == "auto") c.engine = 0;
                else if (e == "event") c.engine = 1;
                else if (e == "fast") c.engine = 2;
                else throw std::invalid_argument("engine must be 'auto', 'event' or 'fast', got '" + e + "'");
            });

    py::class_<SimResult>(m, "SimResult", "Output of simulate(); see csrc/simulator.h.")
        .def_readonly("minibatch_time", &SimResult::minibatch_time)
        .def_readonly("pipeline_time", &SimResult::pipeline_time)
        .def_readonly("bubble_fraction", &SimResult::bubble_fraction)
        .def_readonly("data_wait", &SimResult::data_wait)
        .def_readonly("stage_busy", &SimResult::stage_busy)
        .def_readonly("stage_bubble", &SimResult::stage_bubble)
        .def_readonly("stage_done", &SimResult::stage_done)
        .def_readonly("peak_stashed", &SimResult::peak_stashed)
        .def_readonly("peak_live", &SimResult::peak_live)
        .def_readonly("peak_inflight", &SimResult::peak_inflight)
        .def_readonly("replicas_simulated", &SimResult::replicas_simulated)
        .def_readonly("extrapolated", &SimResult::extrapolated)
        .def_property_readonly("m_simulated",
                               [](const SimResult& r) { return std::make_tuple(r.m_simulated[0], r.m_simulated[1]); })
        .def_readonly("actions", &SimResult::events)
        .def_property_readonly("engine_used",
                               [](const SimResult& r) { return std::string(r.engine_used == 2 ? "fast" : "event"); })
        .def_readonly("period", &SimResult::period)
        .def_property_readonly(
            "timeline",
            [](const SimResult& r) {
                std::vector<std::vector<SegmentTuple>> out(r.timeline.size());
                for (std::size_t i = 0; i < r.timeline.size(); ++i)
                    for (const auto& s : r.timeline[i])
                        out[i].emplace_back(static_cast<int>(s.kind), s.mb, s.start, s.end);
                return out;
            },
            "per simulated rank: [(kind, mb, start, end)], kind 0=F 1=R 2=B 3=WAIT 4=AR 5=TIED 6=SYNC 7=OPT")
        .def_property_readonly(
            "transfers",
            [](const SimResult& r) {
                std::vector<TransferTuple> out;
                out.reserve(r.transfers.size());
                for (const auto& t : r.transfers) out.emplace_back(t.kind, t.mb, t.src, t.dst, t.start, t.end);
                return out;
            },
            "[(kind 0=activation 1=gradient, mb, src rank, dst rank, start, arrival)]");

    m.def(
        "simulate",
        [](SimConfig c) {  // by value: the copy is made with the GIL held
            py::gil_scoped_release nogil;
            return varuna::simulate(c);
        },
        py::arg("config"),
        "Simulate one mini-batch; raises ValueError on bad input. See varuna_sdk.planner.simulate.");
    m.def("allreduce_time", &varuna::allreduce_time, py::arg("bytes"), py::arg("n"), py::arg("ar_alpha"),
          py::arg("ar_beta"), "Ring all-reduce alpha-beta time in seconds (0 when n <= 1 or bytes <= 0).");
}

void bind_search(py::module_& m) {
    using varuna::Candidate;
    using varuna::SearchInput;
    using varuna::SegmentTable;
    py::class_<SegmentTable>(m, "SegmentTable", "Per-segment costs at one micro-batch size (seconds, bytes).")
        .def(py::init<>())
        .def_readwrite("micro_batch_size", &SegmentTable::micro_batch_size)
        .def_readwrite("fwd", &SegmentTable::fwd)
        .def_readwrite("rec", &SegmentTable::rec)
        .def_readwrite("bwd", &SegmentTable::bwd)
        .def_readwrite("bwd_in", &SegmentTable::bwd_in)
        .def_readwrite("wgt", &SegmentTable::wgt)
        .def_readwrite("out_bytes", &SegmentTable::out_bytes)
        .def_readwrite("act_bytes", &SegmentTable::act_bytes);
    py::class_<SearchInput>(m, "SearchInput", "Inputs of search(); see csrc/search.h.")
        .def(py::init<>())
        .def("__copy__", [](const SearchInput& s) { return SearchInput(s); })
        .def_readwrite("gpus", &SearchInput::gpus)
        .def_readwrite("global_batch", &SearchInput::global_batch)
        .def_property(
            "policy", [](const SearchInput& c) { return std::string(varuna::policy_name(c.policy)); },
            [](SearchInput& c, const std::string& p) { c.policy = varuna::parse_policy(p); })
        .def_readwrite("recompute", &SearchInput::recompute)
        .def_readwrite("stage_recompute", &SearchInput::stage_recompute)
        .def_readwrite("max_in_flight", &SearchInput::max_in_flight)
        .def_readwrite("split_backward", &SearchInput::split_backward)
        .def_readwrite("data_read_per_example", &SearchInput::data_read_per_example)
        .def_readwrite("data_prefetch", &SearchInput::data_prefetch)
        .def_readwrite("tables", &SearchInput::tables)
        .def_readwrite("param_bytes", &SearchInput::param_bytes)
        .def_readwrite("tied_segments", &SearchInput::tied_segments)
        .def_readwrite("tied_bytes", &SearchInput::tied_bytes)
        .def_readwrite("optimizer_state_factor", &SearchInput::optimizer_state_factor)
        .def_readwrite("memory_limit", &SearchInput::memory_limit)
        .def_readwrite("max_depth", &SearchInput::max_depth)
        .def_readwrite("fixed_replicas", &SearchInput::fixed_replicas)
        .def_readwrite("fixed_starts", &SearchInput::fixed_starts)
        .def_readwrite("forbidden_starts", &SearchInput::forbidden_starts)
        .def_readwrite("sim", &SearchInput::sim)
        .def_readwrite("opt_s_per_param_byte", &SearchInput::opt_s_per_param_byte)
        .def_readwrite("ar_cpu_share", &SearchInput::ar_cpu_share)
        .def_readwrite("opt_parallelism", &SearchInput::opt_parallelism)
        .def_readwrite("compute_interference", &SearchInput::compute_interference)
        .def_readwrite("sim_cap", &SearchInput::sim_cap)
        .def_readwrite("exhaustive", &SearchInput::exhaustive);
    py::class_<Candidate>(m, "Candidate", "One configuration found by search().")
        .def_readonly("P", &Candidate::P)
        .def_readonly("D", &Candidate::D)
        .def_readonly("micro_batch_size", &Candidate::micro_batch_size)
        .def_readonly("m", &Candidate::m)
        .def_readonly("idle_gpus", &Candidate::idle_gpus)
        .def_readonly("starts", &Candidate::starts)
        .def_readonly("minibatch_time", &Candidate::minibatch_time)
        .def_readonly("bubble_fraction", &Candidate::bubble_fraction)
        .def_readonly("data_wait", &Candidate::data_wait)
        .def_readonly("stage_memory", &Candidate::stage_memory)
        .def_readonly("peak_stashed", &Candidate::peak_stashed)
        .def_readonly("peak_live", &Candidate::peak_live)
        .def_readonly("stage_compute", &Candidate::stage_compute)
        .def_readonly("feasible", &Candidate::feasible)
        .def_readonly("simulated", &Candidate::simulated)
        .def_readonly("reason", &Candidate::reason);
    m.def(
        "search", [](const SearchInput& in) { return varuna::search(in); }, py::arg("input"),
        py::call_guard<py::gil_scoped_release>(), "Rank every (P, D, micro-batch) for the input; see csrc/search.h.");
    m.def(
        "search_with_stats",
        [](const SearchInput& in) {
            varuna::SearchStats st;
            std::vector<Candidate> rows;
            {
                py::gil_scoped_release nogil;
                rows = varuna::search(in, &st);
            }
            py::dict d;
            d["depths"] = st.depths;
            d["candidates"] = st.candidates;
            d["bounded"] = st.bounded;
            d["splits"] = st.splits;
            d["split_failed"] = st.split_failed;
            d["simulated"] = st.simulated;
            d["pruned"] = st.pruned;
            d["actions"] = st.actions;
            d["pruned_rows"] = st.pruned_rows;
            return py::make_tuple(rows, d);
        },
        py::arg("input"),
        "search() and what it did: {depths, candidates, bounded, splits, split_failed, simulated, pruned, actions, "
        "pruned_rows}.");
    m.def("evaluate", &varuna::evaluate, py::arg("input"), py::arg("P"), py::arg("D"), py::arg("table_index"),
          py::call_guard<py::gil_scoped_release>(),
          "One (P, D, micro-batch table) as search() evaluates it (split, simulation, memory).");
    m.def(
        "stage_memory",
        [](const SearchInput& in, int ti, int first, int end, int stashed, int live) {
            const auto& t = in.tables.at(static_cast<std::size_t>(ti));
            const int n = static_cast<int>(t.fwd.size());
            if (first < 0 || end <= first || end > n || stashed < 0 || live < 0)
                throw std::invalid_argument("stage_memory needs 0 <= first < end <= segments and counts >= 0");
            return varuna::stage_memory(in, t, first, end, stashed, live);
        },
        py::arg("input"), py::arg("table_index"), py::arg("first"), py::arg("end"), py::arg("stashed"),
        py::arg("live"),
        "Bytes per GPU of a stage holding segments [first, end) with `stashed` stashed inputs and `live` live "
        "graphs (weights, gradients, optimizer state and activations), as the search counts them.");
    m.def("candidate_lower_bound", &varuna::candidate_lower_bound, py::arg("input"), py::arg("P"), py::arg("D"),
          py::arg("table_index"), py::arg("split_free") = false, py::arg("any_recompute") = false,
          py::call_guard<py::gil_scoped_release>(),
          "search()'s lower bound (seconds) on evaluate()'s mini-batch time (inf when no split fits memory); "
          "split_free: the bound used before splitting, valid for every split; any_recompute: valid for every "
          "per-stage recompute setting and in-flight caps.");
    m.def("simulate_candidate", &varuna::simulate_candidate, py::arg("input"), py::arg("P"), py::arg("D"),
          py::arg("table_index"), py::arg("starts"), py::arg("rank_scale"), py::arg("record_timeline"),
          py::call_guard<py::gil_scoped_release>(),
          "Simulate one candidate for its full m (timeline, straggler what-ifs); see csrc/search.h.");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
    m.doc() = "varuna-sdk C++ core (schedule policies, simulator). Use varuna_sdk.pipeline.schedule and "
              "varuna_sdk.planner.simulate instead.";

    m.attr("FORWARD") = static_cast<int>(varuna::ActionKind::Forward);
    m.attr("RECOMPUTE") = static_cast<int>(varuna::ActionKind::Recompute);
    m.attr("BACKWARD") = static_cast<int>(varuna::ActionKind::Backward);
    m.attr("WEIGHT") = static_cast<int>(varuna::ActionKind::Weight);

    m.def(
        "default_recompute",
        [](const std::string& policy) { return varuna::default_recompute(varuna::parse_policy(policy)); },
        py::arg("policy"));

    m.def(
        "stage_schedule",
        [](const std::string& policy, int P, int mb, int stage, const RecomputeArg& recompute,
           bool split_backward) {
            const auto p = varuna::parse_policy(policy);
            return to_tuples(
                varuna::stage_schedule(p, P, mb, stage, resolve_flags(p, P, recompute), split_backward));
        },
        py::arg("policy"), py::arg("P"), py::arg("m"), py::arg("stage"),
        py::arg("recompute") = py::none(), py::arg("split_backward") = false,
        "Static action list of one stage as [(kind, mb)], kind 0=F 1=R 2=B 3=W.");

    m.def(
        "pipeline_schedule",
        [](const std::string& policy, int P, int mb, const RecomputeArg& recompute, bool split_backward) {
            const auto p = varuna::parse_policy(policy);
            std::vector<std::vector<ActionTuple>> out;
            for (const auto& v :
                 varuna::pipeline_schedule(p, P, mb, resolve_flags(p, P, recompute), split_backward))
                out.push_back(to_tuples(v));
            return out;
        },
        py::arg("policy"), py::arg("P"), py::arg("m"), py::arg("recompute") = py::none(),
        py::arg("split_backward") = false,
        "Static action lists of all stages.");

    py::class_<varuna::StageScheduler>(m, "StageScheduler")
        .def(py::init([](const std::string& policy, int P, int mb, int stage, const RecomputeArg& recompute,
                         bool split_backward, const std::vector<int>& max_in_flight) {
                 const auto p = varuna::parse_policy(policy);
                 return varuna::StageScheduler(p, P, mb, stage, resolve_flags(p, P, recompute), split_backward,
                                               max_in_flight);
             }),
             py::arg("policy"), py::arg("P"), py::arg("m"), py::arg("stage"),
             py::arg("recompute") = py::none(), py::arg("split_backward") = false,
             py::arg("max_in_flight") = std::vector<int>{})
        .def(
            "next",
            [](varuna::StageScheduler& s, int acts_arrived, int grads_arrived) -> std::optional<ActionTuple> {
                auto a = s.next(acts_arrived, grads_arrived);
                if (!a) return std::nullopt;
                return to_tuple(*a);
            },
            py::arg("acts_arrived"), py::arg("grads_arrived"))
        .def("remaining", [](const varuna::StageScheduler& s) { return to_tuples(s.remaining()); })
        .def("remaining_count", &varuna::StageScheduler::remaining_count)
        .def_property_readonly("done", &varuna::StageScheduler::done)
        .def_property_readonly("policy", [](const varuna::StageScheduler& s) {
            return std::string(varuna::policy_name(s.policy()));
        })
        .def_property_readonly("P", &varuna::StageScheduler::num_stages)
        .def_property_readonly("m", &varuna::StageScheduler::num_microbatches)
        .def_property_readonly("stage", &varuna::StageScheduler::stage)
        .def_property_readonly("recompute", &varuna::StageScheduler::recompute)
        .def_property_readonly("split_backward", &varuna::StageScheduler::split_backward)
        .def_property_readonly("max_deferred", &varuna::StageScheduler::max_deferred)
        .def_property_readonly("max_in_flight", &varuna::StageScheduler::max_in_flight)
        .def_property_readonly("in_flight", &varuna::StageScheduler::in_flight);

    bind_simulator(m);
    bind_search(m);
}
