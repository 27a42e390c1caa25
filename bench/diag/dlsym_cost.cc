// What one dlsym of a CUDA runtime function costs on this host: the cuDNN frontend, built with
// dynamic loading (as the launch core is), looks up a CUDA runtime symbol on every such call.
// g++ -O2 dlsym_cost.cc -ldl -o /tmp/dlsym_cost && /tmp/dlsym_cost libcudart.so.13
#include <dlfcn.h>

#include <chrono>
#include <cstdio>

int main(int argc, char **argv) {
    const char *library = argc > 1 ? argv[1] : "libcudart.so.13";
    void *handle = dlopen(library, RTLD_NOW);
    if (handle == nullptr) {
        std::printf("dlopen %s: %s\n", library, dlerror());
        return 1;
    }
    const int calls = 200000;
    void *found = nullptr;
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) {
        dlerror();
        found = dlsym(handle, "cudaMemsetAsync");
    }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / calls;
    std::printf("dlerror + dlsym(%s, cudaMemsetAsync): %.1f ns per lookup (%p)\n", library, ns, found);
    return 0;
}
