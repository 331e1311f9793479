// stokehold's CUDA emulator, compiler side: a libnvrtc that builds CUDA C into a host
// shared object with the system C++ compiler.
//
// The "cubin" it returns is that shared object (an ELF file, as a real cubin is); the
// "PTX" is a line naming it. The emulated driver (cuda.cpp) loads either. It supports one
// architecture, sm_90, and says so through nvrtcGetSupportedArchs.
//
// Built by tests/common/emu.rs with -DEMU_PRELUDE="<path of prelude.h>".

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#ifndef EMU_PRELUDE
#error "build with -DEMU_PRELUDE=<path of prelude.h>"
#endif

typedef int nvrtcResult;
enum {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_OUT_OF_MEMORY = 1,
    NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_INVALID_OPTION = 5,
    NVRTC_ERROR_COMPILATION = 6,
};

struct Program {
    std::string source, name, log, so_path;
    std::vector<char> so;
    bool compiled = false;
};

namespace {

// A kernel of the source: its name, whether its body holds `__syncthreads`, whether it
// has C linkage (`extern "C"`: only those are found by their plain name, as a real
// module's other kernels go by their mangled names), and the most threads a block may
// have (`__launch_bounds__`'s first argument; 1024 without one).
struct Kernel {
    std::string name;
    bool barriers, c_linkage;
    long max_threads;
};

// Whether the `__global__` at `at` is declared `extern "C"`: right before it, or inside an
// `extern "C" { ... }` block.
bool c_linkage(const std::string& s, size_t at) {
    size_t end = at;
    while (end > 0 && isspace((unsigned char)s[end - 1])) --end;
    static const std::string kExtern = "extern \"C\"";
    if (end >= kExtern.size() && s.compare(end - kExtern.size(), kExtern.size(), kExtern) == 0) return true;
    for (size_t block = s.rfind(kExtern, at); block != std::string::npos;
         block = block == 0 ? std::string::npos : s.rfind(kExtern, block - 1)) {
        size_t open = s.find_first_not_of(" \t\r\n", block + kExtern.size());
        if (open == std::string::npos || open >= at || s[open] != '{') continue;
        int depth = 0;
        for (size_t i = open; i < at; ++i) {
            if (s[i] == '{') ++depth;
            if (s[i] == '}') --depth;
        }
        if (depth > 0) return true;
    }
    return false;
}

// The kernels of the source: `__global__ void NAME(`.
std::vector<Kernel> scan(const std::string& s) {
    std::vector<Kernel> out;
    size_t at = 0;
    while ((at = s.find("__global__", at)) != std::string::npos) {
        bool c = c_linkage(s, at);
        at += 10;
        // `__launch_bounds__(...)` may stand between the return type and the name.
        size_t bounds = s.find("__launch_bounds__", at);
        size_t first_paren = s.find('(', at);
        long max_threads = 1024;
        if (bounds != std::string::npos && bounds < first_paren) {
            size_t close = s.find(')', bounds);
            if (close == std::string::npos) break;
            // A literal first argument (a macro or an expression is left at 1024).
            char* after = nullptr;
            long n = strtol(s.c_str() + first_paren + 1, &after, 0);
            if (after && n > 0 && n <= 1024 && (*after == ',' || *after == ')' || isspace((unsigned char)*after)))
                max_threads = n;
            at = close + 1;
        }
        size_t paren = s.find('(', at);
        if (paren == std::string::npos) break;
        size_t end = paren;
        while (end > at && isspace((unsigned char)s[end - 1])) --end;
        size_t start = end;
        while (start > at && (isalnum((unsigned char)s[start - 1]) || s[start - 1] == '_')) --start;
        std::string name = s.substr(start, end - start);
        size_t open = s.find('{', paren);
        if (open == std::string::npos || name.empty()) continue;
        int depth = 0;
        size_t i = open;
        for (; i < s.size(); ++i) {
            if (s[i] == '{') ++depth;
            if (s[i] == '}' && --depth == 0) break;
        }
        bool barrier = s.substr(open, i - open).find("__syncthreads") != std::string::npos;
        out.push_back(Kernel{name, barrier, c, max_threads});
        at = i;
    }
    return out;
}

std::string read_all(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

}  // namespace

extern "C" {

const char* nvrtcGetErrorString(nvrtcResult r) {
    switch (r) {
        case NVRTC_SUCCESS: return "NVRTC_SUCCESS";
        case NVRTC_ERROR_OUT_OF_MEMORY: return "NVRTC_ERROR_OUT_OF_MEMORY";
        case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        case NVRTC_ERROR_INVALID_OPTION: return "NVRTC_ERROR_INVALID_OPTION";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR_UNKNOWN";
    }
}

// STOKEHOLD_EMU_NVRTC_VERSION: this NVRTC's version, "MAJOR.MINOR" (default 99.0, newer
// than the emulated driver: its PTX does not load there).
static void version(int* major, int* minor) {
    const char* v = getenv("STOKEHOLD_EMU_NVRTC_VERSION");
    *major = 99;
    *minor = 0;
    if (v && *v) sscanf(v, "%d.%d", major, minor);
}

// STOKEHOLD_EMU_NVRTC_ARCHS: the real architectures this NVRTC builds for, as
// nvrtcGetSupportedArchs gives them ("75,80,90,100,120"; default "90"). `sm_N` and
// `compute_N` for any other N are refused, as a real NVRTC refuses an architecture it
// does not know.
static std::vector<int> archs() {
    const char* e = getenv("STOKEHOLD_EMU_NVRTC_ARCHS");
    std::string s = e && *e ? e : "90";
    std::vector<int> out;
    std::stringstream in(s);
    for (std::string a; std::getline(in, a, ',');) out.push_back(atoi(a.c_str()));
    return out;
}

nvrtcResult nvrtcVersion(int* major, int* minor) {
    version(major, minor);
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetNumSupportedArchs(int* n) {
    *n = (int)archs().size();
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetSupportedArchs(int* out) {
    for (int a : archs()) *out++ = a;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCreateProgram(Program** prog, const char* src, const char* name, int, const char* const*,
                               const char* const*) {
    if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
    *prog = new Program{src, name ? name : "default_program", "", "", {}, false};
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcDestroyProgram(Program** prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete *prog;
    *prog = nullptr;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCompileProgram(Program* p, int n, const char* const* options) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    // The architecture built for (compute_52 when none is named, as NVRTC 12's default),
    // kept in the image as `emu_target` for the driver to check against the device.
    int target = 52;
    for (int i = 0; i < n; ++i) {
        std::string o = options[i];
        if (o.rfind("--gpu-architecture=", 0) == 0 || o.rfind("-arch=", 0) == 0) {
            std::string a = o.substr(o.find('=') + 1);
            bool sm = a.rfind("sm_", 0) == 0, compute = a.rfind("compute_", 0) == 0;
            int num = sm || compute ? atoi(a.c_str() + a.find('_') + 1) : 0;
            auto known = archs();
            bool ok = num > 0 && std::find(known.begin(), known.end(), num) != known.end();
            // STOKEHOLD_EMU_NO_CUBIN: no cubin at all, as from an NVRTC that knows no
            // real architecture of this device (only PTX would do).
            if (!ok || (sm && getenv("STOKEHOLD_EMU_NO_CUBIN"))) {
                p->log = "nvrtc: error: invalid value for --gpu-architecture (-arch)\n";
                return NVRTC_ERROR_INVALID_OPTION;
            }
            target = num;
        } else if (o != "--use_fast_math" && o != "-lineinfo" && o.rfind("-D", 0) != 0) {
            p->log = "nvrtc: error: unrecognized option " + o + "\n";
            return NVRTC_ERROR_INVALID_OPTION;
        }
    }
    const char* tmp = getenv("TMPDIR");
    std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/stokehold-emu-XXXXXX";
    std::vector<char> d(dir.begin(), dir.end());
    d.push_back(0);
    if (!mkdtemp(d.data())) {
        p->log = "stokehold-emu: cannot make a temporary directory\n";
        return NVRTC_ERROR_COMPILATION;
    }
    dir = d.data();
    std::string src = dir + "/kernels.cpp", so = dir + "/kernels.so", log = dir + "/log";
    {
        std::ofstream f(src);
        f << "#include \"" EMU_PRELUDE "\"\n#line 1 \"" << p->name << "\"\n" << p->source << "\n";
        f << "const emu::Entry emu_entries[] = {\n";
        auto kernels = scan(p->source);
        for (auto& k : kernels) {
            f << "    EMU_ENTRY(" << k.name << ", " << (k.barriers ? "true" : "false") << ", "
              << (k.c_linkage ? "\"\"" : "\"_Z\"") << ", " << k.max_threads << "),\n";
        }
        f << "    emu::Entry{nullptr, nullptr, false, 0, nullptr, nullptr, 0}};\n";
        f << "const int emu_entry_count = " << kernels.size() << ";\n";
        int major, minor;
        version(&major, &minor);
        f << "extern \"C\" const int emu_target = " << target << ";\n";
        f << "extern \"C\" const int emu_nvrtc = " << major * 1000 + minor * 10 << ";\n";
    }
    const char* cxx = getenv("STOKEHOLD_EMU_CXX");
    const char* flags = getenv("STOKEHOLD_EMU_CXXFLAGS");
    std::string cmd = std::string(cxx && *cxx ? cxx : "c++") +
                      " -std=c++17 -O2 -fPIC -shared -w " + (flags ? flags : "") + " -o " + so +
                      " " + src + " >" + log + " 2>&1";
    int rc = system(cmd.c_str());
    p->log = read_all(log);
    if (rc != 0) {
        if (p->log.empty()) p->log = "stokehold-emu: `" + cmd + "` failed\n";
        return NVRTC_ERROR_COMPILATION;
    }
    std::string bytes = read_all(so);
    p->so.assign(bytes.begin(), bytes.end());
    p->so_path = so;
    p->compiled = true;
    unlink(src.c_str());
    unlink(log.c_str());
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetProgramLogSize(Program* p, size_t* n) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    *n = p->log.size() + 1;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetProgramLog(Program* p, char* out) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    std::memcpy(out, p->log.c_str(), p->log.size() + 1);
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetCUBINSize(Program* p, size_t* n) {
    if (!p || !p->compiled) return NVRTC_ERROR_INVALID_PROGRAM;
    *n = p->so.size();
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetCUBIN(Program* p, char* out) {
    if (!p || !p->compiled) return NVRTC_ERROR_INVALID_PROGRAM;
    std::memcpy(out, p->so.data(), p->so.size());
    return NVRTC_SUCCESS;
}

// "PTX": a line naming the shared object, which stays on disk for the process's life.
static std::string ptx_of(Program* p) { return "// stokehold-emu .entry " + p->so_path + "\n"; }

nvrtcResult nvrtcGetPTXSize(Program* p, size_t* n) {
    if (!p || !p->compiled) return NVRTC_ERROR_INVALID_PROGRAM;
    *n = ptx_of(p).size() + 1;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetPTX(Program* p, char* out) {
    if (!p || !p->compiled) return NVRTC_ERROR_INVALID_PROGRAM;
    std::string s = ptx_of(p);
    std::memcpy(out, s.c_str(), s.size() + 1);
    return NVRTC_SUCCESS;
}

}  // extern "C"
