// fusedattn's cuDNN attention as a torch operator with its autograd in C++: the warm path.
//
// Python validates a call, selects the backend, builds and serializes the forward and backward
// graphs and registers them here once per configuration (a "torch plan": the two graphs plus the
// shapes and strides of every tensor the call reads and writes). A repeat call is then one
// operator call: torch.ops.fusedattn_native.attention(plan, q, k, v, sink, seed, offset). Its
// autograd kernel saves what the backward needs; forward and backward allocate their outputs from
// torch's caching allocator and launch the deserialized graph on torch's current stream.
// Meta kernels give the output shapes from the plan, so torch.compile traces the same operator.

#include <atomic>
#include <mutex>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "bounded.h"
#include "core_api.h"

namespace {

using at::Tensor;
using c10::optional;

// The launch core (launch_core.cc), a separate library with its own copy of the cuDNN frontend:
// its C functions, found when Python calls fusedattn_torch_init with its path.
fusedattn_native::CoreApi &core() {
    static fusedattn_native::CoreApi functions;
    return functions;
}

// Slot orders of the two graphs: Python registers each graph's uids in these orders.
enum ForwardSlot { kFwdQ, kFwdK, kFwdV, kFwdSink, kFwdSeed, kFwdOffset, kFwdO, kFwdStats, kForwardSlots };
enum BackwardSlot {
    kBwdQ, kBwdK, kBwdV, kBwdO, kBwdDO, kBwdStats, kBwdSink, kBwdSeed, kBwdOffset,
    kBwdDQ, kBwdDK, kBwdDV, kBwdDSink, kBackwardSlots
};
enum SinkKind { kNoSink = 0, kZeroSink = 1, kLearnableSink = 2 };

// What the operator needs of one configuration beyond its graphs. Shapes are those of the tensors
// the caller passes and gets (q, k, v in their base layout); strides are what the graphs were built
// for (an input with other strides is copied into them).
constexpr int kMaxDevices = 64;

struct TorchPlan {
    int64_t forward = -1, backward = -1;  // core plan ids; backward -1 for an inference configuration
    // Workspace bytes of each graph per device, once the core has deserialized it there (-1: not yet).
    std::atomic<int64_t> workspace[2][kMaxDevices];
    at::ScalarType dtype = at::kBFloat16;
    int64_t sink_kind = kNoSink;
    int64_t heads_q = 0;
    bool stats = false;  // the forward writes the LSE
    std::vector<int64_t> out_sizes, out_strides, lse_sizes;
    std::vector<int64_t> sizes[3], strides[3], grad_strides[3];  // q, k, v

    TorchPlan() {
        for (auto &pass : workspace) {
            for (auto &bytes : pass) bytes.store(-1, std::memory_order_relaxed);
        }
    }
};

fusedattn_native::Bounded<TorchPlan> &torch_plans() {
    static fusedattn_native::Bounded<TorchPlan> plans;
    return plans;
}

constexpr const char *kNotRegistered = "is not registered in this process";

std::shared_ptr<TorchPlan> find_plan(int64_t id) {
    auto plan = torch_plans().find(id);
    TORCH_CHECK(plan != nullptr, "fusedattn: native plan ", id, " ", kNotRegistered,
                " (evicted from the bounded registry, or traced in another process); call "
                "fusedattn.torch.attention again to register it");
    return plan;
}

// x with the strides the graph was built for: x itself when it has them (sizes-1 axes may differ).
Tensor conform(const Tensor &x, const std::vector<int64_t> &sizes, const std::vector<int64_t> &strides,
               const char *name) {
    TORCH_CHECK(x.sizes().equals(sizes), "fusedattn: ", name, ": expected shape ", c10::IntArrayRef(sizes),
                " (the registered plan's), got ", x.sizes());
    bool same = true;
    for (size_t i = 0; i < sizes.size(); ++i) same = same && (sizes[i] == 1 || x.stride(i) == strides[i]);
    if (same && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) return x;
    Tensor copy = at::empty_strided(sizes, strides, x.options());
    copy.copy_(x);
    return copy;
}

void launch(TorchPlan &owner, int pass, const c10::Device &device, const std::vector<void *> &slots,
            const Tensor &like) {
    TORCH_CHECK(core().execute != nullptr, "fusedattn: the launch core is not loaded (fusedattn_torch_init)");
    TORCH_CHECK(device.index() >= 0 && device.index() < kMaxDevices, "fusedattn: device index ", device.index());
    int64_t plan = pass == 0 ? owner.forward : owner.backward;
    int64_t bytes = owner.workspace[pass][device.index()].load(std::memory_order_relaxed);
    if (bytes < 0) {  // the graph's workspace there, deserializing it once
        bytes = core().prepare(plan, device.index());
        TORCH_CHECK(bytes >= 0, "fusedattn: ", core().last_error());
        owner.workspace[pass][device.index()].store(bytes, std::memory_order_relaxed);
    }
    Tensor workspace = bytes > 0 ? at::empty({bytes}, like.options().dtype(at::kByte)) : Tensor();
    const auto *impl = c10::impl::getDeviceGuardImpl(device.type());
    void *stream = impl->getStream(device).native_handle();
    int status = core().execute(plan, device.index(), stream, slots.data(), static_cast<int64_t>(slots.size()),
                                bytes > 0 ? workspace.data_ptr() : nullptr, bytes);
    TORCH_CHECK(status == 0, "fusedattn: ", core().last_error());
}

void *pointer(const optional<Tensor> &x) { return x.has_value() && x->defined() ? x->data_ptr() : nullptr; }

Tensor sink_buffer(const TorchPlan &plan, const optional<Tensor> &sink, const Tensor &like) {
    if (plan.sink_kind == kLearnableSink) {
        TORCH_CHECK(sink.has_value() && sink->defined(), "fusedattn: this plan needs the sink logits");
        return sink->to(at::kFloat).contiguous();
    }
    if (plan.sink_kind == kZeroSink) return at::zeros({1, plan.heads_q, 1, 1}, like.options().dtype(at::kFloat));
    return Tensor();
}

std::vector<Tensor> forward_outputs(const TorchPlan &plan, const Tensor &q) {
    Tensor out = at::empty_strided(plan.out_sizes, plan.out_strides, q.options());
    Tensor lse = plan.stats ? at::empty(plan.lse_sizes, q.options().dtype(at::kFloat))
                            : at::empty({0}, q.options().dtype(at::kFloat));
    return {out, lse};
}

std::vector<Tensor> forward_cuda(int64_t plan_id, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset) {
    auto plan = find_plan(plan_id);
    c10::DeviceGuard guard(q.device());
    Tensor qs = conform(q, plan->sizes[0], plan->strides[0], "q");
    Tensor ks = conform(k, plan->sizes[1], plan->strides[1], "k");
    Tensor vs = conform(v, plan->sizes[2], plan->strides[2], "v");
    Tensor sinks = sink_buffer(*plan, sink, q);
    auto outputs = forward_outputs(*plan, q);
    std::vector<void *> slots(kForwardSlots, nullptr);
    slots[kFwdQ] = qs.data_ptr();
    slots[kFwdK] = ks.data_ptr();
    slots[kFwdV] = vs.data_ptr();
    slots[kFwdSink] = sinks.defined() ? sinks.data_ptr() : nullptr;
    slots[kFwdSeed] = pointer(seed);
    slots[kFwdOffset] = pointer(offset);
    slots[kFwdO] = outputs[0].data_ptr();
    slots[kFwdStats] = plan->stats ? outputs[1].data_ptr() : nullptr;
    launch(*plan, 0, q.device(), slots, q);
    return outputs;
}

void check_shapes(const TorchPlan &plan, const Tensor &q, const Tensor &k, const Tensor &v) {
    const char *names[3] = {"q", "k", "v"};
    const Tensor *tensors[3] = {&q, &k, &v};
    for (int role = 0; role < 3; ++role) {
        TORCH_CHECK(tensors[role]->sizes().equals(plan.sizes[role]), "fusedattn: ", names[role], ": expected shape ",
                    c10::IntArrayRef(plan.sizes[role]), " (the registered plan's), got ", tensors[role]->sizes());
    }
}

std::vector<Tensor> forward_meta(int64_t plan_id, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset) {
    auto plan = find_plan(plan_id);
    check_shapes(*plan, q, k, v);
    return forward_outputs(*plan, q);
}

std::vector<Tensor> backward_outputs(const TorchPlan &plan, const Tensor &q, const optional<Tensor> &sink) {
    std::vector<Tensor> grads;
    for (int role = 0; role < 3; ++role) {
        grads.push_back(at::empty_strided(plan.sizes[role], plan.grad_strides[role], q.options()));
    }
    if (plan.sink_kind != kNoSink) {  // the graph writes dSink for both sink kinds
        grads.push_back(at::empty({1, plan.heads_q, 1, 1}, q.options().dtype(at::kFloat)));
    } else {
        grads.push_back(at::empty({0}, q.options().dtype(at::kFloat)));
    }
    return grads;
}

// cuDNN's backward has no term for a gradient reaching the LSE. One that is absent or all zeros (a
// compiled graph passes zeros for a returned LSE the loss does not use) changes nothing; any other is
// refused, in eager and compiled calls alike, at the cost of one host read in that case only. The text
// is the Python paths' (backends/base.py: no_lse_gradient).
void refuse_lse_gradient(const optional<Tensor> &grad_lse) {
    if (!grad_lse.has_value() || !grad_lse->defined()) return;
    TORCH_CHECK_NOT_IMPLEMENTED(!grad_lse->ne(0).any().item<bool>(),
                                "fusedattn.torch.attention: the cudnn backend has no gradient through the returned "
                                "lse; use backend='reference' for losses that depend on lse");
}

std::vector<Tensor> backward_cuda(int64_t plan_id, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &lse, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset) {
    auto plan = find_plan(plan_id);
    TORCH_CHECK(plan->backward >= 0, "fusedattn: native plan ", plan_id, " was registered for inference");
    refuse_lse_gradient(grad_lse);
    c10::DeviceGuard guard(q.device());
    Tensor qs = conform(q, plan->sizes[0], plan->strides[0], "q");
    Tensor ks = conform(k, plan->sizes[1], plan->strides[1], "k");
    Tensor vs = conform(v, plan->sizes[2], plan->strides[2], "v");
    Tensor dout = conform(grad_out, plan->out_sizes, plan->out_strides, "grad_out");
    Tensor sinks = sink_buffer(*plan, sink, q);
    auto grads = backward_outputs(*plan, q, sink);
    std::vector<void *> slots(kBackwardSlots, nullptr);
    slots[kBwdQ] = qs.data_ptr();
    slots[kBwdK] = ks.data_ptr();
    slots[kBwdV] = vs.data_ptr();
    slots[kBwdO] = out.data_ptr();
    slots[kBwdDO] = dout.data_ptr();
    slots[kBwdStats] = lse.data_ptr();
    slots[kBwdSink] = sinks.defined() ? sinks.data_ptr() : nullptr;
    slots[kBwdSeed] = pointer(seed);
    slots[kBwdOffset] = pointer(offset);
    slots[kBwdDQ] = grads[0].data_ptr();
    slots[kBwdDK] = grads[1].data_ptr();
    slots[kBwdDV] = grads[2].data_ptr();
    slots[kBwdDSink] = grads[3].numel() ? grads[3].data_ptr() : nullptr;
    launch(*plan, 1, q.device(), slots, q);
    return grads;
}

std::vector<Tensor> backward_meta(int64_t plan_id, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &lse, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset) {
    auto plan = find_plan(plan_id);
    check_shapes(*plan, q, k, v);
    return backward_outputs(*plan, q, sink);
}

std::vector<Tensor> call_forward(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::forward", "")
                         .typed<decltype(forward_cuda)>();
    return op.call(plan, q, k, v, sink, seed, offset);
}

std::vector<Tensor> call_backward(int64_t plan, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &lse, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::backward", "")
                         .typed<decltype(backward_cuda)>();
    return op.call(plan, grad_out, grad_lse, q, k, v, out, lse, sink, seed, offset);
}

Tensor defined_or_empty(const optional<Tensor> &x) { return x.has_value() ? *x : Tensor(); }

optional<Tensor> as_optional(const Tensor &x) { return x.defined() ? optional<Tensor>(x) : c10::nullopt; }

class Attention : public torch::autograd::Function<Attention> {
   public:
    static std::vector<Tensor> forward(torch::autograd::AutogradContext *ctx, int64_t plan, const Tensor &q,
                                       const Tensor &k, const Tensor &v, const optional<Tensor> &sink,
                                       const optional<Tensor> &seed, const optional<Tensor> &offset) {
        at::AutoDispatchBelowADInplaceOrView below;
        auto outputs = call_forward(plan, q, k, v, sink, seed, offset);
        ctx->saved_data["plan"] = plan;
        ctx->save_for_backward({q, k, v, outputs[0], outputs[1], defined_or_empty(sink), defined_or_empty(seed),
                                defined_or_empty(offset)});
        ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined
        return outputs;
    }

    static std::vector<Tensor> backward(torch::autograd::AutogradContext *ctx, std::vector<Tensor> grads) {
        auto saved = ctx->get_saved_variables();
        Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
        auto result = call_backward(ctx->saved_data["plan"].toInt(), grad_out, as_optional(grads[1]), saved[0],
                                    saved[1], saved[2], saved[3], saved[4], as_optional(saved[5]),
                                    as_optional(saved[6]), as_optional(saved[7]));
        Tensor dsink;  // learnable sinks only: an off-by-one sink is no input
        if (saved[5].defined() && result[3].numel()) dsink = result[3].reshape({-1}).to(saved[5].scalar_type());
        return {Tensor(), result[0], result[1], result[2], dsink, Tensor(), Tensor()};
    }
};

bool requires_grad(const optional<Tensor> &x) { return x.has_value() && x->defined() && x->requires_grad(); }

std::vector<Tensor> attention_autograd(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                       const optional<Tensor> &sink, const optional<Tensor> &seed,
                                       const optional<Tensor> &offset) {
    if (at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                       requires_grad(sink))) {
        return Attention::apply(plan, q, k, v, sink, seed, offset);
    }
    // Nothing to differentiate: the forward alone, without an autograd node and saved tensors.
    at::AutoDispatchBelowADInplaceOrView below;
    return call_forward(plan, q, k, v, sink, seed, offset);
}

}  // namespace

TORCH_LIBRARY(fusedattn_native, m) {
    m.def("attention(int plan, Tensor q, Tensor k, Tensor v, Tensor? sink, Tensor? seed, Tensor? offset) "
          "-> Tensor[]");
    m.def("forward(int plan, Tensor q, Tensor k, Tensor v, Tensor? sink, Tensor? seed, Tensor? offset) -> Tensor[]");
    m.def("backward(int plan, Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
          "Tensor lse, Tensor? sink, Tensor? seed, Tensor? offset) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(fusedattn_native, Autograd, m) { m.impl("attention", &attention_autograd); }
TORCH_LIBRARY_IMPL(fusedattn_native, CUDA, m) {
    m.impl("attention", &attention_autograd);
    m.impl("forward", &forward_cuda);
    m.impl("backward", &backward_cuda);
}
TORCH_LIBRARY_IMPL(fusedattn_native, Meta, m) {
    m.impl("attention", &attention_autograd);
    m.impl("forward", &forward_meta);
    m.impl("backward", &backward_meta);
}

#ifdef FUSEDATTN_PYTHON_ENTRY
// A Python function calling the operator through the dispatcher, typed: the warm path's way in when the
// library is built with Python's headers. It costs less than torch.ops' boxed call, which converts
// each argument through the schema; autograd, capture and every dispatch key still apply.
#include <torch/csrc/utils/pybind.h>

namespace {

std::tuple<Tensor, Tensor> call_attention(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                          const optional<Tensor> &sink, const optional<Tensor> &seed,
                                          const optional<Tensor> &offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::attention", "")
                         .typed<decltype(attention_autograd)>();
    auto outputs = op.call(plan, q, k, v, sink, seed, offset);
    return {outputs[0], outputs[1]};
}

}  // namespace

// torch's errors as torch.ops raises them: its Python types, without the C++ backtrace.
void translate_error(std::exception_ptr error) {
    auto raise = [](PyObject *type, const c10::Error &e) { PyErr_SetString(type, e.what_without_backtrace()); };
    try {
        if (error) std::rethrow_exception(error);
    } catch (const c10::OutOfMemoryError &e) {
        raise(pybind11::module_::import("torch").attr("OutOfMemoryError").ptr(), e);
    } catch (const c10::NotImplementedError &e) {
        raise(PyExc_NotImplementedError, e);
    } catch (const c10::ValueError &e) {
        raise(PyExc_ValueError, e);
    } catch (const c10::TypeError &e) {
        raise(PyExc_TypeError, e);
    } catch (const c10::IndexError &e) {
        raise(PyExc_IndexError, e);
    } catch (const c10::Error &e) {
        raise(PyExc_RuntimeError, e);
    }
}

PYBIND11_MODULE(libfusedattn_torch, m) {
    pybind11::register_local_exception_translator(&translate_error);
    m.def("attention", &call_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
}
#endif

// The library's exports besides the operator registration (built with hidden visibility).
#pragma GCC visibility push(default)

extern "C" {

static thread_local std::string fusedattn_error;

const char *fusedattn_torch_last_error() { return fusedattn_error.c_str(); }

// Finds the launch core's functions in the library at `core_path` (already loaded by Python). 0 on success.
int fusedattn_torch_init(const char *core_path) {
    fusedattn_error = fusedattn_native::load_core(core_path, &core());
    return fusedattn_error.empty() ? 0 : 1;
}

// A torch plan from two core plans (backward -1 for inference) and its shapes, flattened:
// dtype code (c10::ScalarType), sink kind, Hq, stats, out sizes[4], out strides[4], lse sizes[3],
// then for q, k, v: sizes[4], strides[4], gradient strides[4]. Its id, or -1.
int64_t fusedattn_torch_plan(int64_t forward, int64_t backward, const int64_t *shape, int64_t count) {
    constexpr int64_t kCount = 4 + 4 + 4 + 3 + 3 * 12;
    if (count != kCount) {
        fusedattn_error = "expected " + std::to_string(kCount) + " shape entries, got " + std::to_string(count);
        return -1;
    }
    auto plan = std::make_shared<TorchPlan>();
    plan->forward = forward;
    plan->backward = backward;
    const int64_t *next = shape;
    auto take = [&next](int64_t n) {
        std::vector<int64_t> values(next, next + n);
        next += n;
        return values;
    };
    plan->dtype = static_cast<at::ScalarType>(*next++);
    plan->sink_kind = *next++;
    plan->heads_q = *next++;
    plan->stats = *next++ != 0;
    plan->out_sizes = take(4);
    plan->out_strides = take(4);
    plan->lse_sizes = take(3);
    for (int role = 0; role < 3; ++role) {
        plan->sizes[role] = take(4);
        plan->strides[role] = take(4);
        plan->grad_strides[role] = take(4);
    }
    return torch_plans().add(plan);
}

// Sets the torch plans' bound (when capacity > 0); the number of plans held.
int64_t fusedattn_torch_bounds(int64_t capacity) {
    if (capacity > 0) torch_plans().set_capacity(capacity);
    return torch_plans().size();
}

}  // extern "C"

#pragma GCC visibility pop
