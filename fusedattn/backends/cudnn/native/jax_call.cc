// fusedattn's cuDNN graphs as an XLA FFI custom call, launched by the shared launch core.
//
// Python builds a graph, serializes it and puts the bytes, the uid each buffer binds to and
// their digest into the call's attributes, with the graph's pass-by-value numbers (4-byte values,
// bound after the buffers, by host pointers into the attribute). XLA then runs the call like any
// custom call: no Python, no GIL, no torch at run time. The core keeps plans by digest in its bounded registry; a program
// whose plan it no longer holds (evicted, or compiled in another process) registers its own bytes
// again, so no compiled program ever names a plan that cannot run. The workspace is one more result
// buffer, sized when the call was traced (XLA's scratch allocator refused FFI calls on the GPU:
// measured). No cuDNN or CUDA header here: the core owns the only copy of the frontend.

#include <cstdint>
#include <string>
#include <vector>

#include "core_api.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;
using fusedattn_native::kUnbound;
using fusedattn_native::kWorkspace;

struct CUstream_st;
using cudaStream_t = CUstream_st *;

fusedattn_native::CoreApi &core() {
    static fusedattn_native::CoreApi functions;
    return functions;
}

ffi::Error Execute(cudaStream_t stream, int32_t device, int64_t plan, ffi::Span<const uint8_t> blob,
                   ffi::Span<const int64_t> uids, ffi::Span<const int32_t> scalars, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
    if (core().execute == nullptr) {
        return ffi::Error::Internal("fusedattn: the launch core is not loaded (fusedattn_jax_init)");
    }
    const size_t buffers = args.size() + rets.size();
    if (buffers + scalars.size() != uids.size()) {
        return ffi::Error::InvalidArgument("fusedattn: plan " + std::to_string(plan) + " binds " +
                                           std::to_string(uids.size()) + " slots, the call has " +
                                           std::to_string(buffers) + " buffers and " +
                                           std::to_string(scalars.size()) + " scalars");
    }
    std::vector<void *> slots(uids.size(), nullptr);
    void *workspace = nullptr;
    int64_t workspace_bytes = 0;
    for (size_t i = 0; i < args.size(); ++i) {
        if (uids[i] == kUnbound) continue;
        auto buffer = args.get<ffi::AnyBuffer>(i);
        if (buffer.has_error()) return buffer.error();
        slots[i] = buffer->untyped_data();
    }
    for (size_t i = 0; i < rets.size(); ++i) {
        int64_t uid = uids[args.size() + i];
        if (uid == kUnbound) continue;
        auto buffer = rets.get<ffi::AnyBuffer>(i);
        if (buffer.has_error()) return buffer.error();
        slots[args.size() + i] = (*buffer)->untyped_data();
        if (uid == kWorkspace) {
            workspace = slots[args.size() + i];
            workspace_bytes = static_cast<int64_t>((*buffer)->size_bytes());
        }
    }
    for (size_t i = 0; i < scalars.size(); ++i) {  // cuDNN copies pass-by-value inputs at launch
        slots[buffers + i] = const_cast<int32_t *>(scalars.begin() + i);
    }
    auto run = [&] {
        return core().execute(plan, device, stream, slots.data(), static_cast<int64_t>(slots.size()), workspace,
                              workspace_bytes);
    };
    int status = run();
    if (status == fusedattn_native::kNotRegistered) {
        int64_t again = core().register_plan(blob.begin(), static_cast<int64_t>(blob.size()), uids.begin(),
                                             static_cast<int64_t>(uids.size()), plan);
        status = again == plan ? run() : -1;
    }
    if (status != 0) return ffi::Error::Internal(std::string("fusedattn: ") + core().last_error());
    return ffi::Error::Success();
}

}  // namespace

// Built with hidden visibility; these are the library's only exports.
#pragma GCC visibility push(default)

#define FUSEDATTN_EXECUTE_BINDING                           \
    ffi::Ffi::Bind()                                        \
        .Ctx<ffi::PlatformStream<cudaStream_t>>()           \
        .Ctx<ffi::DeviceOrdinal>()                          \
        .Attr<int64_t>("plan")                              \
        .Attr<ffi::Span<const uint8_t>>("blob")             \
        .Attr<ffi::Span<const int64_t>>("uids")             \
        .Attr<ffi::Span<const int32_t>>("scalars")          \
        .RemainingArgs()                                    \
        .RemainingRets()

XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedattn_cudnn_execute, Execute, FUSEDATTN_EXECUTE_BINDING);

// The same handler, declared safe to record into XLA's command buffers (CUDA graphs): it launches
// only cuDNN's kernels on XLA's stream, into XLA's buffers (the workspace is one), and never waits.
// XLA then replays a program's kernels and this call as one graph, with no host work per kernel.
// (A plan the core must register again, under capture, fails the capture; XLA reports it.)
XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedattn_cudnn_execute_graphable, Execute, FUSEDATTN_EXECUTE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

static thread_local std::string jax_error;

const char *fusedattn_jax_last_error() { return jax_error.c_str(); }

// Finds the launch core's functions in the library at `core_path` (already loaded by Python). 0 on success.
int fusedattn_jax_init(const char *core_path) {
    jax_error = fusedattn_native::load_core(core_path, &core());
    return jax_error.empty() ? 0 : 1;
}

}  // extern "C"

#pragma GCC visibility pop
