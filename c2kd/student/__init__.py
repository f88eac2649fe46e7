"""Stage two: distilling a student from a teacher cache; losses and evaluation."""
