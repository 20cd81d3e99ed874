/* MPI_Allreduce timed like `dtrain bench allreduce` (float32, sum): per size, warm-up, then
 * ITERS timed calls; the slowest rank's mean time. Built by bench/allreduce_peers.sh with mpicc.
 * Usage: mpirun -np N mpi_allreduce MINBYTES MAXBYTES ITERS WARMUP LABEL */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  long lo = atol(argv[1]), hi = atol(argv[2]);
  int iters = atoi(argv[3]), warmup = atoi(argv[4]);
  const char* label = argv[5];
  for (long size = lo; size <= hi; size *= 2) {
    long count = size / 4;
    float* buf = malloc(size);
    for (long i = 0; i < count; ++i) buf[i] = 1.0f;
    for (int i = 0; i < warmup; ++i) MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; ++i) MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double us = (MPI_Wtime() - start) / iters * 1e6, worst;
    MPI_Reduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      double algbw = size / worst / 1e3;
      printf("%s %ld %.1f %.3f %.3f\n", label, size, worst, algbw, algbw * 2 * (world - 1) / world);
      fflush(stdout);
    }
    free(buf);
  }
  MPI_Finalize();
  return 0;
}
