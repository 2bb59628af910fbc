/* Kernel calls made from argument blocks: how a recorded decode step is replayed from C (replay_cpu.c).

   Each kernel a replay may call has a twin `<kernel>_packed(const packed_arg *args)` that calls it with args[0],
   args[1], ... read as the member its parameter needs, and a string `<kernel>_signature` naming those members in
   order, one letter each: p (pointer), l (long), i (int), f (float). The Python side fills each block by that
   string and checks it against the kernel's ctypes argument types (kernels/native_calls.py `bind_packed`), so a
   twin that disagrees with its kernel's declaration is refused when the library loads, not misread in a step. */
#ifndef DSV4_PACKED_CALL_H
#define DSV4_PACKED_CALL_H

typedef union {
    void *p;
    long l;
    int i;
    float f;
} packed_arg;

#endif
