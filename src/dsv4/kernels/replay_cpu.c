/* Runs a recorded decode step's kernel calls from C (kernels/native_calls.py `Replay`): one call from Python for
   the ~150 of a step, where calling each through ctypes cost ~1 us of host time apiece (~130 us a small-config step
   with warm caches, ~240 us right after the step's weights have streamed through them). */
#include "packed_call.h"

typedef int (*packed_kernel)(const packed_arg *args);

/* Calls kernels[c](args[c]) for c in [first, first + count), in order, until one returns a non-zero status:
   returns -1 when none did, else that call's index, its status in *status (the calls after it are not made). */
long replay_calls(long first, long count, const packed_kernel *kernels, const packed_arg *const *args, int *status) {
    for (long c = first; c < first + count; ++c) {
        const int s = kernels[c](args[c]);
        if (s) {
            *status = s;
            return c;
        }
    }
    return -1;
}
