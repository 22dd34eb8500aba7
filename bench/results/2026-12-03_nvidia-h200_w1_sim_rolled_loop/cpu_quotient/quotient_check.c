// Session 36, on the CPU (no GPU): for every fp32 v at one scale s, does the branch-free quotient
//   q0 = RN(v * RN(1/s)); t = RN(q0 * s - v) (fma); q = |q0| < 512 ? RN(q0 - t * RN(1/s)) (fma) : q0
// equal RN(v / s)? Counts fp32 differences where |v/s| is in [2^-12, 512) and e4m3 byte
// differences anywhere. Not part of the package (bench/NOTES.md, thirty-sixth session).
//   gcc -O2 -ffp-contract=off -o quotient_check quotient_check.c -lm && ./quotient_check 0.37
// Built with -march=native, gcc's folding of the negated fma lost -0's sign (one byte
// difference at v = -0 at every scale); without it, fmaf is the library's and exact.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static inline float f_of(uint32_t u){float f;memcpy(&f,&u,4);return f;}
static inline uint32_t u_of(float f){uint32_t u;memcpy(&u,&f,4);return u;}
// e4m3fn saturate, RN-even, NaN -> 0x7F (sign kept irrelevant here: compare quotients instead)
static uint8_t e4m3(float x){
  if (x != x) return 0x7F;
  uint8_t sign = (u_of(x) >> 24) & 0x80; float a = fabsf(x);
  if (a >= 464.f) return sign | 0x7E;  // satfinite: 448 is the largest code; 464 ties to it (even)
  // enumerate: find nearest code by brute force over 127 magnitudes
  int best = 0; float bd = INFINITY;
  for (int c = 0; c < 0x7F; ++c) {
    int e = (c >> 3) & 0xF, m = c & 7;
    float val = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, e - 7);
    float d = fabsf(val - a);
    if (d < bd || (d == bd && (c & 1) == 0 && (best & 1))) { bd = d; best = c; }
  }
  return sign | best;
}
int main(int argc, char** argv){
  float s = strtof(argv[1], 0);
  float inv = 1.0f / s;  // RN
  uint64_t bad_byte = 0, bad_q = 0, n = 0;
  uint32_t lo = argc > 2 ? strtoul(argv[2],0,0) : 0, hi = argc > 3 ? strtoul(argv[3],0,0) : 0xFFFFFFFFu;
  for (uint64_t uu = lo; uu <= hi; ++uu) {
    float v = f_of((uint32_t)uu);
    float exact = v / s;
    float q0 = v * inv;
    float t = fmaf(q0, s, -v);
    float q1 = fmaf(-t, inv, q0);
    float q = fabsf(q0) < 512.f ? q1 : q0;
    n++;
    if (u_of(q) != u_of(exact) && !(q != q && exact != exact)) {
      float ae = fabsf(exact);
      if (ae >= 0x1p-12f && ae < 512.f) { if (bad_q < 5) printf("q mismatch v=%a s=%a exact=%a q=%a\n", v, s, exact, q); bad_q++; }
      // byte compare only where they differ (rare), brute force e4m3 is slow
      if (e4m3(q) != e4m3(exact)) { if (bad_byte < 5) printf("BYTE mismatch v=%a exact=%a q=%a\n", v, exact, q); bad_byte++; }
    }
  }
  printf("scale %a inv %a: n %llu q-mismatch(in range) %llu byte-mismatch %llu\n", s, inv, (unsigned long long)n, (unsigned long long)bad_q, (unsigned long long)bad_byte);
}
