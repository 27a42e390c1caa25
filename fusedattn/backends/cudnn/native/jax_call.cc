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
//
// A padded or THD call also runs Triton kernels around the graph, as the torch operator does (its
// sequence table before, the fix-ups of the rows cuDNN leaves after): their cubins, and each launch's
// arguments as 8-byte words, are attributes too (jax/sequence_steps.py plans them). A word is a number,
// or a buffer's address plus a byte offset; a graph slot past the scalars is such an address too (the
// table's rows, which the graph reads as sequence lengths and ragged offsets).

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bounded.h"
#include "core_api.h"
#include "triton_launch.h"
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

// A call's Triton kernels, kept by the digest Python gave them (bounded; a program whose set was
// evicted, or compiled in another process, makes it again from its attributes).
struct KernelSet {
    std::vector<std::unique_ptr<fusedattn_native::TritonKernel>> kernels;
};

fusedattn_native::Bounded<KernelSet> &kernel_sets() {
    static fusedattn_native::Bounded<KernelSet> sets;
    return sets;
}

// Per kernel in `meta`: image offset, image bytes, name offset, name bytes, warps, shared bytes (offsets
// into `images`).
constexpr size_t kKernelMeta = 6;

std::shared_ptr<KernelSet> find_kernels(int64_t key, ffi::Span<const uint8_t> images, ffi::Span<const int64_t> meta,
                                        std::string *error) {
    if (meta.size() == 0) return nullptr;
    if (auto found = kernel_sets().find(key)) return found;
    if (meta.size() % kKernelMeta != 0) {
        *error = "kernel attributes of " + std::to_string(meta.size()) + " numbers";
        return nullptr;
    }
    auto made = std::make_shared<KernelSet>();
    const char *base = reinterpret_cast<const char *>(images.begin());
    for (size_t i = 0; i < meta.size(); i += kKernelMeta) {
        const int64_t *m = meta.begin() + i;
        if (m[0] < 0 || m[2] < 0 || m[0] + m[1] > int64_t(images.size()) || m[2] + m[3] > int64_t(images.size())) {
            *error = "a kernel image lies outside its attribute";
            return nullptr;
        }
        made->kernels.push_back(std::make_unique<fusedattn_native::TritonKernel>(
            std::string(base + m[0], static_cast<size_t>(m[1])), std::string(base + m[2], static_cast<size_t>(m[3])),
            static_cast<int>(m[4]), static_cast<int>(m[5])));
    }
    kernel_sets().add(key, made);
    return made;
}

// The address a word or derived slot names: buffer `index` (args, then results) plus `offset` bytes.
void *address(const std::vector<void *> &buffers, int64_t index, int64_t offset) {
    return static_cast<char *>(buffers[static_cast<size_t>(index)]) + offset;
}

// Calls visit(kernel, blocks, words) for each launch of `steps` whose phase is `phase` (0 before the
// graph, 1 after), in order; "" when all ran, else why not (visit's own reason included). A launch is
// phase, kernel, blocks, word count, then per word (buffer index or -1, value): a buffer's address plus
// value bytes, or the value itself.
template <class Visit>
std::string each_launch(int64_t phase, ffi::Span<const int64_t> steps, const std::vector<void *> &buffers,
                        Visit visit) {
    size_t at = 0;
    std::vector<uint64_t> words;
    while (at + 4 <= steps.size()) {
        const int64_t *head = steps.begin() + at;
        int64_t count = head[3];
        if (count < 0 || at + 4 + 2 * size_t(count) > steps.size()) return "a launch's words lie outside its attribute";
        if (head[0] == phase) {
            words.clear();
            for (int64_t w = 0; w < count; ++w) {
                int64_t index = head[4 + 2 * w], value = head[5 + 2 * w];
                if (index >= int64_t(buffers.size())) return "a launch word names buffer " + std::to_string(index);
                words.push_back(index < 0 ? static_cast<uint64_t>(value)
                                          : reinterpret_cast<uint64_t>(address(buffers, index, value)));
            }
            std::string error = visit(head[1], head[2], words);
            if (!error.empty()) return error;
        }
        at += 4 + 2 * size_t(count);
    }
    return at == steps.size() ? "" : "the launch steps end mid-launch";
}

// Launches the kernels of `steps` whose phase is `phase` on `stream`.
std::string run_steps(int64_t phase, ffi::Span<const int64_t> steps, const KernelSet *kernels,
                      const std::vector<void *> &buffers, int32_t device, cudaStream_t stream) {
    return each_launch(phase, steps, buffers, [&](int64_t kernel, int64_t blocks, std::vector<uint64_t> &words) {
        if (kernels == nullptr || kernel < 0 || kernel >= int64_t(kernels->kernels.size())) {
            return "a launch names kernel " + std::to_string(kernel) + ", which the call lacks";
        }
        return kernels->kernels[size_t(kernel)]->launch(device, stream, blocks, words);
    });
}

ffi::Error Execute(cudaStream_t stream, int32_t device, int64_t plan, ffi::Span<const uint8_t> blob,
                   ffi::Span<const int64_t> uids, ffi::Span<const int32_t> scalars, int64_t kernels_key,
                   ffi::Span<const uint8_t> kernel_images, ffi::Span<const int64_t> kernel_meta,
                   ffi::Span<const int64_t> steps, ffi::Span<const int64_t> derived, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
    if (core().execute == nullptr) {
        return ffi::Error::Internal("fusedattn: the launch core is not loaded (fusedattn_jax_init)");
    }
    const size_t buffers = args.size() + rets.size();
    const size_t derived_slots = derived.size() / 2;  // (buffer index, byte offset) per slot
    if (derived.size() % 2 != 0 || buffers + scalars.size() + derived_slots != uids.size()) {
        return ffi::Error::InvalidArgument("fusedattn: plan " + std::to_string(plan) + " binds " +
                                           std::to_string(uids.size()) + " slots, the call has " +
                                           std::to_string(buffers) + " buffers, " +
                                           std::to_string(scalars.size()) + " scalars and " +
                                           std::to_string(derived_slots) + " derived slots");
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
    const bool own_kernels = steps.size() > 0 || derived_slots > 0;
    std::vector<void *> addresses;
    if (own_kernels) addresses.assign(slots.begin(), slots.begin() + buffers);
    for (size_t i = 0; own_kernels && i < buffers; ++i) {  // unbound buffers have addresses the kernels read
        if (addresses[i] != nullptr) continue;
        if (i < args.size()) {
            auto buffer = args.get<ffi::AnyBuffer>(i);
            if (buffer.has_error()) return buffer.error();
            addresses[i] = buffer->untyped_data();
        } else {
            auto buffer = rets.get<ffi::AnyBuffer>(i - args.size());
            if (buffer.has_error()) return buffer.error();
            addresses[i] = (*buffer)->untyped_data();
        }
    }
    for (size_t i = 0; i < derived_slots; ++i) {
        int64_t index = derived[2 * i];
        if (index < 0 || index >= int64_t(buffers)) return ffi::Error::InvalidArgument("fusedattn: a derived slot's buffer");
        slots[buffers + scalars.size() + i] = address(addresses, index, derived[2 * i + 1]);
    }
    std::string error;
    auto kernels = find_kernels(kernels_key, kernel_images, kernel_meta, &error);
    if (error.empty() && steps.size() > 0) error = run_steps(0, steps, kernels.get(), addresses, device, stream);
    if (!error.empty()) return ffi::Error::Internal("fusedattn: " + error);
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
    if (steps.size() > 0) error = run_steps(1, steps, kernels.get(), addresses, device, stream);
    if (!error.empty()) return ffi::Error::Internal("fusedattn: " + error);
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
        .Attr<int64_t>("kernels_key")                       \
        .Attr<ffi::Span<const uint8_t>>("kernel_images")    \
        .Attr<ffi::Span<const int64_t>>("kernel_meta")      \
        .Attr<ffi::Span<const int64_t>>("steps")            \
        .Attr<ffi::Span<const int64_t>>("derived")          \
        .RemainingArgs()                                    \
        .RemainingRets()

XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedattn_cudnn_execute, Execute, FUSEDATTN_EXECUTE_BINDING);

// The same handler, declared safe to record into XLA's command buffers (CUDA graphs): it launches
// only kernels (cuDNN's and the call's own) on XLA's stream, into XLA's buffers (the workspace and a
// sequence table are ones), and never waits. XLA then replays a program's kernels and this call as one
// graph, with no host work per kernel. (A plan the core must register again, or a kernel loaded for
// the first time, under capture, fails the capture; XLA reports it. Python loads both when it traces.)
XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedattn_cudnn_execute_graphable, Execute, FUSEDATTN_EXECUTE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

static thread_local std::string jax_error;

const char *fusedattn_jax_last_error() { return jax_error.c_str(); }

// Keeps the kernel set `key` (images and meta as the call's attributes give them) and loads each of its
// kernels on `device`, so that no call of a program traced now loads one under capture. 0 on success.
int fusedattn_jax_prepare_kernels(int64_t key, const uint8_t *images, int64_t image_bytes, const int64_t *meta,
                                  int64_t meta_count, int32_t device) {
    jax_error.clear();
    auto kernels = find_kernels(key, ffi::Span<const uint8_t>(images, size_t(image_bytes)),
                                ffi::Span<const int64_t>(meta, size_t(meta_count)), &jax_error);
    if (kernels == nullptr && jax_error.empty()) jax_error = "no kernels";
    for (size_t i = 0; kernels != nullptr && jax_error.empty() && i < kernels->kernels.size(); ++i) {
        jax_error = kernels->kernels[i]->prepare(device);
    }
    return jax_error.empty() ? 0 : 1;
}

// What the handler would launch for `steps` in `phase` with buffer i at addresses[i], written to `out`
// as kernel, blocks, word count, words... per launch (at most `capacity` numbers): the count written,
// or -1 (jax_last_error says why). Python's tests check their encoding against it.
int64_t fusedattn_jax_launch_words(const int64_t *steps, int64_t count, int64_t phase, const uint64_t *addresses,
                                   int64_t buffers, uint64_t *out, int64_t capacity) {
    jax_error.clear();
    std::vector<void *> buffer_at(static_cast<size_t>(buffers), nullptr);
    for (int64_t i = 0; i < buffers; ++i) buffer_at[size_t(i)] = reinterpret_cast<void *>(addresses[i]);
    int64_t written = 0;
    jax_error = each_launch(phase, ffi::Span<const int64_t>(steps, size_t(count)), buffer_at,
                            [&](int64_t kernel, int64_t blocks, std::vector<uint64_t> &words) -> std::string {
                                if (written + 3 + int64_t(words.size()) > capacity) return "out of room";
                                out[written++] = uint64_t(kernel);
                                out[written++] = uint64_t(blocks);
                                out[written++] = words.size();
                                for (uint64_t word : words) out[written++] = word;
                                return "";
                            });
    return jax_error.empty() ? written : -1;
}

// Finds the launch core's functions in the library at `core_path` (already loaded by Python). 0 on success.
int fusedattn_jax_init(const char *core_path) {
    jax_error = fusedattn_native::load_core(core_path, &core());
    return jax_error.empty() ? 0 : 1;
}

}  // extern "C"

#pragma GCC visibility pop
