// Runtime of the kernel shim: fibers per GPU thread, a seeded random scheduler per threadgroup,
// threadgroups over host worker threads, launches read from a job file (see shim.py).
// Included once, after the kernels and the generated `shim_thunks` table.
#pragma once

#include <cstdarg>
#include <fstream>
#include <mutex>
#include <sstream>
#include <sys/mman.h>

namespace shim {

namespace {

enum State { READY, AT_SIMD, AT_BARRIER, DONE };

struct Fiber {
    ucontext_t ctx;
    char* stack = nullptr;
    ThreadIds ids;
    State state = DONE;
    const char* site = "";
    void* fake_stack = nullptr;
};

struct SimdGroup {
    int first = 0, n = 0, arrived = 0;
    Lane16 vals[SIMD];
    Lane16 snap[SIMD];
    bool alive[SIMD];
};

constexpr size_t STACK = 256 * 1024;
constexpr size_t TG_LIMIT = 32 * 1024;  // Metal's threadgroup memory per group (CUDA's static limit is 48 KB)
constexpr size_t CANARY = SHIM_ASAN ? 0 : 64;

struct Launch {
    std::string label;
    int thunk = 0;
    uint3v grid{}, tg{};
    uint64_t seed = 0;
    unsigned char poison = 0xff;
    int workers = 1;
    unsigned yield_tg = 2, yield_dev = 8;  // switch with probability 1/N at such memory points
    bool cuda = false;  // CUDA geometry: every block full size (see run_group)
};

struct Group {
    const Launch* L = nullptr;
    void* const* bufs = nullptr;
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;  // reused across the worker's groups
    std::vector<SimdGroup> sgs;
    ucontext_t sched;
    void* sched_fake = nullptr;
    const void* sched_stack_bottom = nullptr;
    size_t sched_stack_size = 0;
    int cur = -1;
    int barrier_arrived = 0, done = 0;
    std::mt19937_64 rng;
    std::vector<std::pair<std::string, void*>> tg_mem;
    size_t tg_used = 0;
    uint3v pos{};
};

thread_local Group* g_group = nullptr;
const Launch* g_launch = nullptr;
std::mutex g_fail_mutex;

}  // namespace

[[noreturn]] void fail(const char* fmt, ...) {
    std::lock_guard<std::mutex> lock(g_fail_mutex);
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    Group* g = g_group;
    if (g && g->cur >= 0) {
        const ThreadIds& t = g->fibers[g->cur].ids;
        std::fprintf(stderr, "SHIM-FAIL [%s] threadgroup (%u,%u,%u) thread (%u,%u,%u): %s\n",
                     g_launch ? g_launch->label.c_str() : "?", g->pos.x, g->pos.y, g->pos.z,
                     t.thread_position_in_grid.x, t.thread_position_in_grid.y, t.thread_position_in_grid.z, msg);
    } else if (g) {
        std::fprintf(stderr, "SHIM-FAIL [%s] threadgroup (%u,%u,%u): %s\n",
                     g_launch ? g_launch->label.c_str() : "?", g->pos.x, g->pos.y, g->pos.z, msg);
    } else {
        std::fprintf(stderr, "SHIM-FAIL [%s]: %s\n", g_launch ? g_launch->label.c_str() : "?", msg);
    }
    std::fflush(stderr);
    std::fflush(stdout);
    _exit(86);
}

const char* space_name(int s) {
    return s == DEVICE ? "device" : s == CONSTANT ? "constant" : s == THREADGROUP ? "threadgroup" : "thread";
}

void check_align(const void* p, size_t align, size_t size, int space, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % align) {
        fail("misaligned %zu-byte access in %s memory (address %% %zu = %zu; Metal needs %zu-byte alignment): %s",
             size, space_name(space), align, size_t(reinterpret_cast<uintptr_t>(p) % align), align, what);
    }
}

unsigned char poison_byte() { return g_launch ? g_launch->poison : 0xff; }

const ThreadIds& current_ids() {
    Group* g = g_group;
    if (!g || g->cur < 0) fail("thread ids read outside a kernel");
    return g->fibers[g->cur].ids;
}

// ---------------------------------------------------------------------------------------------
// fiber switching (with the annotations ASan needs to follow stacks)

static void to_scheduler(Group& g, bool dying) {
    Fiber& f = g.fibers[g.cur];
#if SHIM_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f.fake_stack, g.sched_stack_bottom, g.sched_stack_size);
#endif
    (void)dying;
    swapcontext(&f.ctx, &g.sched);
#if SHIM_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

static void fiber_main() {
    Group& g = *g_group;
#if SHIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g.sched_stack_bottom, &g.sched_stack_size);
#endif
    Fiber& f = g.fibers[g.cur];
    shim_thunks[g.L->thunk](g.bufs, f.ids);
    f.state = DONE;
    g.done++;
    to_scheduler(g, true);
    fail("a finished GPU thread was resumed");
}

void memory_point(int space, bool write) {
    Group* g = g_group;
    if (!g || g->cur < 0) return;
    unsigned n = space == THREADGROUP ? g->L->yield_tg : (write ? g->L->yield_dev : 0);
    if (n && g->rng() % n == 0) {
        g->fibers[g->cur].state = READY;
        to_scheduler(*g, false);
    }
}

const Lane16* simd_exchange(const Lane16& mine, const char* site, const bool** alive, uint* lane) {
    Group* g = g_group;
    if (!g || g->cur < 0) fail("SIMD function called outside a kernel");
    Fiber& f = g->fibers[g->cur];
    SimdGroup& sg = g->sgs[f.ids.simdgroup_index_in_threadgroup];
    const uint l = f.ids.thread_index_in_simdgroup;
    sg.vals[l] = mine;
    f.site = site;
    f.state = AT_SIMD;
    sg.arrived++;
    to_scheduler(*g, false);
    if (alive) *alive = sg.alive;
    if (lane) *lane = l;
    return sg.snap;
}

void tg_barrier(const char* site) {
    Group* g = g_group;
    if (!g || g->cur < 0) fail("threadgroup_barrier called outside a kernel");
    Fiber& f = g->fibers[g->cur];
    f.site = site;
    f.state = AT_BARRIER;
    g->barrier_arrived++;
    to_scheduler(*g, false);
}

void* tg_alloc(const char* key, size_t size, size_t align) {
    Group* g = g_group;
    if (!g) fail("threadgroup memory outside a kernel");
    for (auto& kv : g->tg_mem)
        if (kv.first == key) return kv.second;
    g->tg_used += size;
    if (g->tg_used > TG_LIMIT) fail("threadgroup memory %zu bytes exceeds Metal's %zu", g->tg_used, TG_LIMIT);
    // its own heap block, so ASan sees overruns; poisoned like uninitialised GPU memory
    void* p = nullptr;
    if (posix_memalign(&p, align < 16 ? 16 : align, size ? size : 1)) fail("out of memory");
    std::memset(p, g->L->poison, size);
    g->tg_mem.emplace_back(key, p);
    return p;
}

// ---------------------------------------------------------------------------------------------
// scheduler

static std::string describe_waits(Group& g) {
    std::map<std::string, int> count;
    for (auto& f : g.fibers) {
        if (f.state == AT_SIMD) count[std::string("SIMD op at ") + f.site + " (simdgroup " +
                                       std::to_string(f.ids.simdgroup_index_in_threadgroup) + ")"]++;
        else if (f.state == AT_BARRIER) count[std::string("threadgroup_barrier at ") + f.site]++;
        else if (f.state == DONE) count["returned"]++;
    }
    std::string s;
    for (auto& kv : count) s += std::to_string(kv.second) + " threads " + kv.first + "; ";
    return s;
}

// Release waiters whose rendezvous is complete; fail where it never can be.
static void settle(Group& g) {
    if (g.barrier_arrived) {
        const char* site = nullptr;
        for (auto& f : g.fibers) {
            if (f.state == AT_BARRIER) {
                if (site && std::strcmp(site, f.site)) {
                    fail("diverged threadgroup barriers: %s", describe_waits(g).c_str());
                }
                site = f.site;
            }
        }
        if (g.done) fail("threadgroup_barrier at %s reached after threads of the group returned: %s", site,
                         describe_waits(g).c_str());
        if (g.barrier_arrived == int(g.fibers.size())) {
            for (auto& f : g.fibers) f.state = READY;
            g.barrier_arrived = 0;
        }
    }
    for (auto& sg : g.sgs) {
        if (!sg.arrived) continue;
        int live = 0;
        const char* site = nullptr;
        for (int i = 0; i < sg.n; ++i) {
            Fiber& f = g.fibers[sg.first + i];
            if (f.state == DONE) continue;
            live++;
            if (f.state == AT_SIMD) {
                if (site && std::strcmp(site, f.site))
                    fail("diverged SIMD lanes: %s", describe_waits(g).c_str());
                site = f.site;
            }
        }
        if (sg.arrived == live) {
            for (int i = 0; i < SIMD; ++i) {
                const bool on = i < sg.n && g.fibers[sg.first + i].state == AT_SIMD;
                sg.alive[i] = on;
                if (on) sg.snap[i] = sg.vals[i];
                else std::memset(sg.snap[i].b, g.L->poison, sizeof sg.snap[i].b);
            }
            for (int i = 0; i < sg.n; ++i)
                if (g.fibers[sg.first + i].state == AT_SIMD) g.fibers[sg.first + i].state = READY;
            sg.arrived = 0;
        }
    }
}

static void run_group(Group& g, uint3v pos) {
    const Launch& L = *g.L;
    g.pos = pos;
    const uint3v T{L.tg.x, L.tg.y, L.tg.z};
    // Metal: MLX dispatches exact grids (dispatchThreads), so the last group along an axis is cut short.
    // CUDA: MLX launches ceil(grid / threadgroup) blocks of min(threadgroup, grid) threads
    // (mlx/backend/cuda/custom_kernel.cpp, CustomKernel::eval_gpu), so every block is full and threads
    // past the grid run too; the kernel must guard them.
    const uint3v A = L.cuda ? T
                            : uint3v{std::min(T.x, L.grid.x - pos.x * T.x), std::min(T.y, L.grid.y - pos.y * T.y),
                                     std::min(T.z, L.grid.z - pos.z * T.z)};
    const int n = int(A.x * A.y * A.z);
    const uint3v groups{(L.grid.x + T.x - 1) / T.x, (L.grid.y + T.y - 1) / T.y, (L.grid.z + T.z - 1) / T.z};
    g.fibers.assign(size_t(n), Fiber{});
    while (g.stacks.size() < size_t(n)) {
        void* s = mmap(nullptr, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (s == MAP_FAILED) fail("cannot map a fiber stack");
        g.stacks.push_back(static_cast<char*>(s));
    }
    g.sgs.assign(size_t((n + SIMD - 1) / SIMD), SimdGroup{});
    for (size_t s = 0; s < g.sgs.size(); ++s) {
        g.sgs[s].first = int(s) * SIMD;
        g.sgs[s].n = std::min(SIMD, n - int(s) * SIMD);
    }
    g.rng.seed(L.seed * 0x9E3779B97F4A7C15ull ^ (uint64_t(pos.x) << 42) ^ (uint64_t(pos.y) << 21) ^ pos.z);
    g.barrier_arrived = 0;
    g.done = 0;
    for (int i = 0; i < n; ++i) {
        Fiber& f = g.fibers[size_t(i)];
        const uint x = uint(i) % A.x, y = (uint(i) / A.x) % A.y, z = uint(i) / (A.x * A.y);
        ThreadIds& t = f.ids;
        t.thread_position_in_threadgroup = {x, y, z};
        t.thread_position_in_grid = {pos.x * T.x + x, pos.y * T.y + y, pos.z * T.z + z};
        t.threadgroup_position_in_grid = pos;
        t.threads_per_threadgroup = A;
        t.dispatch_threads_per_threadgroup = T;
        t.threadgroups_per_grid = groups;
        t.threads_per_grid = L.grid;
        t.grid_size = L.grid;
        t.grid_origin = {0, 0, 0};
        t.thread_index_in_threadgroup = uint(i);
        t.thread_index_in_simdgroup = uint(i) % SIMD;
        t.simdgroup_index_in_threadgroup = uint(i) / SIMD;
        t.simdgroups_per_threadgroup = uint(g.sgs.size());
        t.dispatch_simdgroups_per_threadgroup = (T.x * T.y * T.z + SIMD - 1) / SIMD;
        t.threads_per_simdgroup = SIMD;
        t.thread_execution_width = SIMD;
        t.thread_index_in_quadgroup = uint(i) % 4;
        t.quadgroup_index_in_threadgroup = uint(i) / 4;
        t.quadgroups_per_threadgroup = uint(n + 3) / 4;
        t.dispatch_quadgroups_per_threadgroup = (T.x * T.y * T.z + 3) / 4;
        f.stack = g.stacks[size_t(i)];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
        f.state = READY;
        f.site = "";
    }
    std::vector<int> ready;
    ready.reserve(size_t(n));
    for (;;) {
        ready.clear();
        for (int i = 0; i < n; ++i)
            if (g.fibers[size_t(i)].state == READY) ready.push_back(i);
        if (ready.empty()) {
            if (g.done == n) break;
            g.cur = -1;
            fail("deadlock: %s", describe_waits(g).c_str());
        }
        const int pick = ready[g.rng() % ready.size()];
        g.cur = pick;
        Fiber& f = g.fibers[size_t(pick)];
#if SHIM_ASAN
        __sanitizer_start_switch_fiber(&g.sched_fake, f.stack, STACK);
#endif
        swapcontext(&g.sched, &f.ctx);
#if SHIM_ASAN
        __sanitizer_finish_switch_fiber(g.sched_fake, nullptr, nullptr);
#endif
        settle(g);
        g.cur = -1;
    }
    for (auto& kv : g.tg_mem) std::free(kv.second);
    g.tg_mem.clear();
    g.tg_used = 0;
}

static void on_alarm(int) {
    static const char msg[] = "SHIM-FAIL timeout: the launch did not finish (a hang: lanes or threads waiting forever)\n";
    ssize_t r = write(2, msg, sizeof msg - 1);
    (void)r;
    _exit(124);
}

static std::vector<char> read_file(const std::string& path, size_t expect) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot read %s", path.c_str());
    std::vector<char> buf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (buf.size() != expect) fail("%s: %zu bytes, expected %zu", path.c_str(), buf.size(), expect);
    return buf;
}

// Job file: per launch
//   launch LABEL THUNK GX GY GZ TX TY TZ SEED POISON WORKERS TIMEOUT YIELD_TG YIELD_DEV DIALECT NBUFS
//   buf KIND OFFSET SIZE PATH        (NBUFS times; KIND in: read, out: poisoned, init: read; out/init written)
static int run_jobs(const char* job_path) {
    std::ifstream job(job_path);
    if (!job) fail("cannot open job file %s", job_path);
    std::signal(SIGALRM, on_alarm);
    std::string word;
    while (job >> word) {
        if (word != "launch") fail("bad job file near '%s'", word.c_str());
        Launch L;
        unsigned poison, timeout;
        int nbufs;
        std::string dialect;
        job >> L.label >> L.thunk >> L.grid.x >> L.grid.y >> L.grid.z >> L.tg.x >> L.tg.y >> L.tg.z >> L.seed
            >> poison >> L.workers >> timeout >> L.yield_tg >> L.yield_dev >> dialect >> nbufs;
        if (dialect != "metal" && dialect != "cuda") fail("bad dialect '%s' in the job file", dialect.c_str());
        L.cuda = dialect == "cuda";
        L.poison = (unsigned char)poison;
        g_launch = &L;
        struct B { std::string kind, path; size_t off, size; void* base; };
        std::vector<B> bufs{size_t(nbufs)};
        std::vector<void*> ptrs(size_t(nbufs), nullptr);
        for (auto& b : bufs) {
            std::string tag;
            job >> tag >> b.kind >> b.off >> b.size >> b.path;
            // exactly offset + size bytes under ASan, so it flags any access past the end; without ASan,
            // CANARY poisoned bytes follow and are checked after the launch (a stray write past the end).
            // 256-aligned like MTLBuffers.
            if (posix_memalign(&b.base, 256, b.off + b.size + CANARY + (b.off + b.size + CANARY == 0)))
                fail("out of memory");
            char* p = static_cast<char*>(b.base) + b.off;
            std::memset(b.base, L.poison, b.off);
            std::memset(p + b.size, L.poison, CANARY);
            if (b.kind == "out") {
                std::memset(p, L.poison, b.size);
            } else {
                auto data = read_file(b.path, b.size);
                std::memcpy(p, data.data(), b.size);
            }
            ptrs[&b - bufs.data()] = p;
        }
        alarm(timeout);
        if (L.cuda) L.tg = uint3v{std::min(L.tg.x, L.grid.x), std::min(L.tg.y, L.grid.y), std::min(L.tg.z, L.grid.z)};
        const uint3v T = L.tg;
        const uint3v groups{(L.grid.x + T.x - 1) / T.x, (L.grid.y + T.y - 1) / T.y, (L.grid.z + T.z - 1) / T.z};
        const size_t n_groups = size_t(groups.x) * groups.y * groups.z;
        std::atomic<size_t> next{0};
        auto worker = [&] {
            Group g;
            g.L = &L;
            g.bufs = ptrs.data();
            g_group = &g;
            for (size_t k; (k = next.fetch_add(1)) < n_groups;) {
                run_group(g, uint3v{uint(k % groups.x), uint((k / groups.x) % groups.y),
                                    uint(k / (size_t(groups.x) * groups.y))});
            }
            for (char* s : g.stacks) munmap(s, STACK);
            g_group = nullptr;
        };
        std::vector<std::thread> pool;
        for (int w = 1; w < L.workers; ++w) pool.emplace_back(worker);
        worker();
        for (auto& t : pool) t.join();
        alarm(0);
        for (auto& b : bufs) {
            const unsigned char* end = static_cast<unsigned char*>(b.base) + b.off + b.size;
            for (size_t i = 0; i < CANARY; ++i)
                if (end[i] != L.poison) fail("write past the end of buffer %s (%zu bytes): canary byte %zu changed",
                                             b.path.c_str(), b.size, i);
            if (b.kind != "in") {
                std::ofstream out(b.path, std::ios::binary);
                out.write(static_cast<char*>(b.base) + b.off, std::streamsize(b.size));
                if (!out) fail("cannot write %s", b.path.c_str());
            }
            std::free(b.base);
        }
        std::printf("SHIM-OK %s\n", L.label.c_str());
        std::fflush(stdout);
        g_launch = nullptr;
    }
    return 0;
}

}  // namespace shim

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s JOBFILE\n", argv[0]);
        return 2;
    }
    return shim::run_jobs(argv[1]);
}
