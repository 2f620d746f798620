from analysis.figures import main

main()
