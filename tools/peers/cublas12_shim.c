/* libcublas.so.12 for a machine that has only CUDA 13's cuBLAS: FAISS's GPU wheel (built for
   CUDA 12) imports eight cuBLAS entry points; each is forwarded to libcublas.so.13, whose
   signatures for these calls are unchanged. Used only to run the FAISS peer in the bench. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void *target(const char *name) {
    static void *lib;
    if (!lib) {
        const char *path = getenv("CUBLAS13_PATH");
        lib = dlopen(path ? path : "libcublas.so.13", RTLD_NOW | RTLD_GLOBAL);
        if (!lib) { fprintf(stderr, "cublas12 shim: %s\n", dlerror()); abort(); }
    }
    void *f = dlsym(lib, name);
    if (!f) { fprintf(stderr, "cublas12 shim: no %s\n", name); abort(); }
    return f;
}

typedef int (*fn1)(void *);
typedef int (*fn2)(void *, void *);
int cublasCreate_v2(void *h) { return ((fn1)target("cublasCreate_v2"))(h); }
int cublasDestroy_v2(void *h) { return ((fn1)target("cublasDestroy_v2"))(h); }
int cublasSetStream_v2(void *h, void *s) { return ((fn2)target("cublasSetStream_v2"))(h, s); }
int cublasGetMathMode(void *h, void *m) { return ((fn2)target("cublasGetMathMode"))(h, m); }
int cublasSetMathMode(void *h, int m) {
    return ((int (*)(void *, int))target("cublasSetMathMode"))(h, m);
}
/* the GEMMs keep every argument as the caller passed it: a pointer-sized slot each */
typedef int (*fn_many)(void *, long, long, long, long, long, long, long, long, long, long, long,
                       long, long, long, long, long, long, long, long, long, long, long);
#define FORWARD(name) \
    int name(void *h, long a1, long a2, long a3, long a4, long a5, long a6, long a7, long a8, \
             long a9, long a10, long a11, long a12, long a13, long a14, long a15, long a16, \
             long a17, long a18, long a19, long a20, long a21, long a22) { \
        return ((fn_many)target(#name))(h, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, \
                                         a13, a14, a15, a16, a17, a18, a19, a20, a21, a22); }
FORWARD(cublasGemmEx)
FORWARD(cublasGemmStridedBatchedEx)
FORWARD(cublasSgemmEx)
